"""SSD tier: one checksummed file per chunk in a local directory.

Layout: ``<path>/chunks/<first 2 hex>/<96-hex ChunkKey>.kv``; writes in flight live in
``<path>/tmp/<random>.tmp`` (leftovers are removed at start-up). The file format (a 4096-byte
header block, then the payload; with KV events on the block also holds the chunk's token ids
and parent, ``describe``/``describe_many``) is in ``ssd_format.py``.

Durability (``fsync``): every write goes to a tmp file that is renamed into place.
``"never"`` (default) fsyncs nothing: a crash can lose recent chunks, but torn bytes are never
served, because the header and payload checksum are verified on every read (a bad file is
dropped). ``"always"`` fsyncs the tmp file before the rename and the shard directory after it,
so a chunk whose ``put`` returned survives a crash.

Capacity: a ``SizeLedger`` (``ledger.py``) counts each chunk's file size (header, payload,
padding), or the bytes reserved by its write in flight; ``put`` reserves before writing, so
``used_bytes`` never exceeds the capacity. A put over an existing key removes the old file
first: the key misses until the new one is in place. A put of a key whose write is in flight
is refused (``False``): that write stores the same chunk, and one write per key keeps the
ledger's one size per key exact.

Concurrency: one lock guards the LRU index and the metadata operations that must agree with it
(rename into place, unlink); reads, writes, checksums and fsyncs run outside it. At start-up the
index is rebuilt from the headers alone, oldest mtime first (the order ``scan`` reports).
``put_many`` and ``read_many_into`` reserve room and look keys up in input order, then spread
the file I/O over ``IO_THREADS`` threads the tier starts on first use and stops in ``close``
(2-4 concurrent O_DIRECT I/Os measured 1.3-1.5x faster than one).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

import xxhash

from lmcache_svc.errors import ConfigError, Corrupted, InvalidArgument, TierError
from lmcache_svc.keys import CHUNK_KEY_BYTES, ChunkKey
from lmcache_svc.tiers._fileio import (
    BounceBuffers,
    IoThreads,
    align_up,
    fsync_dir,
    pwrite_all,
    read_head_and_body,
    remove_quietly,
    unlink,
    write_head_and_body,
)
from lmcache_svc.tiers.base import Buffer, ChunkDescription, ItemResult, Tier
from lmcache_svc.tiers.ledger import SizeLedger
from lmcache_svc.tiers.ssd_format import (
    BLOCK,
    HEADER,
    key_from_name,
    pack_header,
    parse_description,
    parse_header,
)

logger = logging.getLogger(__name__)

IO_THREADS = 4
"""Threads per tier for batch I/O."""

FsyncPolicy = Literal["never", "always"]


@dataclass(slots=True)
class _Entry:
    length: int  # payload bytes
    file_bytes: int  # bytes on disk: header block, payload and padding


class SsdTier(Tier):
    """Chunks as checksummed files under ``path``; see the module docstring."""

    medium = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        fsync: FsyncPolicy = "never",
        o_direct: bool = False,
        name: str = "ssd",
    ) -> None:
        if fsync not in ("never", "always"):
            raise ConfigError(f"ssd tier fsync must be 'never' or 'always', got {fsync!r}")
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ConfigError(f"ssd tier capacity_bytes must be >= 0, got {capacity_bytes!r}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.path = os.fspath(path)
        self._chunks_dir = os.path.join(self.path, "chunks")
        self._tmp_dir = os.path.join(self.path, "tmp")
        self._fsync = fsync == "always"
        self._o_direct = o_direct
        direct = getattr(os, "O_DIRECT", 0) if o_direct else 0
        self._read_flags = os.O_RDONLY | os.O_CLOEXEC | direct
        self._write_flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | direct
        self._lock = threading.Lock()
        self._index: OrderedDict[ChunkKey, _Entry] = OrderedDict()
        self._ledger = SizeLedger(capacity_bytes)  # file bytes of indexed and in-flight keys
        self._writing: set[ChunkKey] = set()  # keys whose write is in flight (not indexed)
        self._direct_bounce = BounceBuffers() if o_direct else None
        self._io = IoThreads(IO_THREADS, name, logger)
        self._prepare_dirs()
        self._probe_write()
        self._load_index()

    # -- Tier contract ----------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._ledger.used_bytes

    @property
    def num_chunks(self) -> int:
        with self._lock:
            return len(self._index)

    def put(self, key: ChunkKey, data: Buffer) -> bool:
        payload = _payload(key, data)
        entry = self._reserve(key, len(payload))
        return entry is not None and self._store(key, payload, entry)

    def read_into(self, key: ChunkKey, out: memoryview) -> bool:
        view = self._lookup(key, out)
        return view is not None and self._read_file(key, view)

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[ItemResult]:
        """``put`` of each item, room reserved in input order, writes on the I/O threads.

        A chunk whose write raises ``TierError`` reads ``Failed`` (logged; its room given
        back, its old file already gone); the others keep their results. A batch that
        repeats a key is written one put after another.
        """
        keys = [key for key, _ in items]
        payloads = [_payload(key, data) for key, data in items]
        if len(set(keys)) < len(keys):  # the last put of a key must win, as in sequence
            puts = [partial(self.put, key, data) for key, data in zip(keys, payloads)]
            return self._io.run("write", keys, puts, parallel=False)
        stores = [self._reserved_store(key, data) for key, data in zip(keys, payloads)]
        return self._io.run("write", keys, stores)

    def read_many_into(self, items: Sequence[tuple[ChunkKey, memoryview]]) -> list[ItemResult]:
        """``read_into`` of each item, looked up in input order, read on the I/O threads.

        A chunk whose read raises ``TierError`` (``Corrupted``: dropped) reads ``Failed``
        (logged); the others keep their results.
        """
        keys = [key for key, _ in items]
        views = [self._lookup(key, out) for key, out in items]
        reads = [
            None if view is None else partial(self._read_file, key, view)
            for key, view in zip(keys, views)
        ]
        return self._io.run("read", keys, reads)

    def size_of(self, key: ChunkKey) -> int | None:
        with self._lock:
            entry = self._index.get(key)
        return None if entry is None else entry.length

    def delete(self, key: ChunkKey) -> int:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return 0
            unlink(self._path_of(key))
            del self._index[key]
            self._ledger.drop(key)
        return entry.file_bytes

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [key in self._index for key in keys]

    def scan(self) -> Iterator[tuple[ChunkKey, int]]:
        with self._lock:
            items = [(key, entry.length) for key, entry in self._index.items()]
        yield from items

    def describe_many(self, keys: Sequence[ChunkKey]) -> list[ChunkDescription | None]:
        """Each chunk's stored description, from its file's header block (one 4 KiB read per
        file, the payload untouched); a damaged one is logged and answers ``None``."""
        return [self._description(key) for key in keys]

    def close(self) -> None:
        """Stop the batch I/O threads; later batches run on the caller's thread."""
        self._io.close()

    # -- start-up ---------------------------------------------------------------------------

    def _prepare_dirs(self) -> None:
        try:
            for shard in range(256):
                os.makedirs(os.path.join(self._chunks_dir, f"{shard:02x}"), exist_ok=True)
            os.makedirs(self._tmp_dir, exist_ok=True)
            leftovers = os.listdir(self._tmp_dir)
            for name in leftovers:
                os.unlink(os.path.join(self._tmp_dir, name))
        except OSError as e:
            msg = f"ssd tier path {self.path!r} is not a writable directory: {e}"
            raise ConfigError(msg) from None
        if leftovers:
            logger.warning("ssd tier %s: removed %d leftover tmp files", self.path, len(leftovers))
        if self._fsync:
            fsync_dir(self._chunks_dir)

    def _probe_write(self) -> None:
        """Write and remove one block the way chunks are written, to fail at start-up."""
        probe = os.path.join(self._tmp_dir, f"probe-{uuid.uuid4().hex}.tmp")
        try:
            fd = os.open(probe, self._write_flags, 0o644)
            try:
                bounce = self._direct_bounce
                block = bounce.get(BLOCK)[:BLOCK] if bounce else memoryview(bytes(BLOCK))
                pwrite_all(fd, [block], 0)
            finally:
                os.close(fd)
                remove_quietly(probe)
        except OSError as e:
            if self._o_direct and e.errno == errno.EINVAL:
                raise ConfigError(
                    f"ssd tier path {self.path!r}: the filesystem rejects O_DIRECT "
                    f"({e.strerror}); set o_direct off for this path"
                ) from None
            raise ConfigError(f"ssd tier path {self.path!r} is not writable: {e}") from None

    def _load_index(self) -> None:
        found: list[tuple[int, ChunkKey, _Entry]] = []
        for shard in sorted(os.listdir(self._chunks_dir)):
            shard_dir = os.path.join(self._chunks_dir, shard)
            for name in os.listdir(shard_dir) if os.path.isdir(shard_dir) else ():
                item = self._check_file(shard, name)
                if item is not None:
                    found.append(item)
        found.sort(key=lambda item: (item[0], item[1]))
        for _mtime, key, entry in found:
            self._index[key] = entry
            self._ledger.record(key, entry.file_bytes)
        while self._ledger.used_bytes > self.capacity_bytes:
            key, entry = self._index.popitem(last=False)
            logger.warning("ssd tier %s: over capacity, removing %s", self.path, key.hex())
            unlink(self._path_of(key))
            self._ledger.drop(key)

    def _check_file(self, shard: str, name: str) -> tuple[int, ChunkKey, _Entry] | None:
        """(mtime, key, entry) of a valid chunk file; removes an invalid one."""
        path = os.path.join(self._chunks_dir, shard, name)
        key = key_from_name(shard, name)
        if key is None:
            logger.warning("ssd tier: ignoring unexpected file %s", path)
            return None
        try:
            with open(path, "rb") as f:
                raw = f.read(HEADER.size)
                st = os.fstat(f.fileno())
            length, _checksum = parse_header(raw, key, st.st_size)
        except FileNotFoundError:
            return None
        except ValueError as e:
            logger.warning("ssd tier: removing bad chunk file %s: %s", path, e)
            remove_quietly(path)
            return None
        except OSError as e:
            raise TierError(f"{path}: {e.strerror}") from None
        return st.st_mtime_ns, key, _Entry(length, st.st_size)

    def _description(self, key: ChunkKey) -> ChunkDescription | None:
        path = self._path_of(key)
        try:
            with open(path, "rb") as f:
                raw = f.read(BLOCK)
                size = os.fstat(f.fileno()).st_size
            parse_header(raw, key, size)
            return parse_description(raw, key)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            logger.warning("ssd tier: chunk %s: description refused: %s", key.hex(), e)
            return None

    # -- writes -----------------------------------------------------------------------------

    def _reserve(self, key: ChunkKey, length: int) -> _Entry | None:
        """Claim the file bytes of a ``length``-byte put of ``key``, removing its old file;
        ``None`` when they do not fit or the key's write is already in flight."""
        entry = _Entry(length, self._file_bytes(length))
        with self._lock:
            if key in self._writing:
                return None
            fits, old = self._ledger.reserve(key, entry.file_bytes)
            if not fits:
                return None
            if old is not None:
                try:
                    unlink(self._path_of(key))
                except BaseException:
                    self._ledger.unreserve(key, entry.file_bytes, old)  # still on disk
                    raise
                del self._index[key]
            self._writing.add(key)
            return entry

    def _reserved_store(self, key: ChunkKey, payload: memoryview) -> Callable[[], bool] | None:
        """Room reserved now, the write for later: ``None`` when it does not fit, a call that
        raises when reserving failed (removing the old file), so the batch reports it."""
        try:
            entry = self._reserve(key, len(payload))
        except TierError as e:
            return partial(_raise, e)
        return None if entry is None else partial(self._store, key, payload, entry)

    def _store(self, key: ChunkKey, payload: memoryview, entry: _Entry) -> bool:
        """Write and index a chunk whose bytes ``_reserve`` claimed; releases them on failure."""
        try:
            path = self._commit(key, self._write_tmp(key, payload), entry)
        except BaseException:
            with self._lock:
                self._writing.discard(key)
                self._ledger.drop(key)  # its old file, if any, was removed by ``_reserve``
            raise
        if self._fsync:
            fsync_dir(os.path.dirname(path))
        return True

    def _write_tmp(self, key: ChunkKey, payload: memoryview) -> str:
        tmp = os.path.join(self._tmp_dir, f"{uuid.uuid4().hex}.tmp")
        header = pack_header(key, payload, None if self.describe is None else self.describe(key))
        try:
            fd = os.open(tmp, self._write_flags, 0o644)
            try:
                write_head_and_body(fd, header, payload, self._direct_bounce)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            remove_quietly(tmp)
            raise TierError(f"writing {tmp}: {e.strerror}") from None
        return tmp

    def _commit(self, key: ChunkKey, tmp: str, entry: _Entry) -> str:
        """Rename ``tmp`` into place and index it (its bytes are already reserved)."""
        path = self._path_of(key)
        with self._lock:
            try:
                os.replace(tmp, path)
            except OSError as e:
                remove_quietly(tmp)
                raise TierError(f"{path}: {e.strerror}") from None
            self._writing.discard(key)
            self._index[key] = entry
        return path

    # -- reads ------------------------------------------------------------------------------

    def _read_file(self, key: ChunkKey, view: memoryview) -> bool:
        path = self._path_of(key)
        try:
            fd = os.open(path, self._read_flags)
        except FileNotFoundError:
            self._drop(key, path, None)
            return False
        except OSError as e:
            raise TierError(f"{path}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            raw, got = read_head_and_body(fd, HEADER.size, view, self._direct_bounce)
        except OSError as e:
            raise TierError(f"{path}: {e.strerror}") from None
        finally:
            os.close(fd)
        try:
            length, checksum = parse_header(raw, key, st.st_size)
        except ValueError as e:
            self._drop(key, path, st)
            raise Corrupted(f"{path}: {e}; chunk dropped") from None
        if length != len(view):
            return False  # replaced meanwhile by a chunk of another size
        if got < length or xxhash.xxh3_64_intdigest(view) != checksum:
            self._drop(key, path, st)
            raise Corrupted(f"{path}: payload checksum mismatch; chunk dropped")
        return True

    def _drop(self, key: ChunkKey, path: str, seen: os.stat_result | None) -> None:
        """Forget ``key`` if its file vanished, or remove it if it is still the file ``seen``."""
        with self._lock:
            try:
                now: os.stat_result | None = os.stat(path)
            except FileNotFoundError:
                now = None
            if now is not None:
                if seen is None or (now.st_dev, now.st_ino) != (seen.st_dev, seen.st_ino):
                    return  # a put replaced it meanwhile
                unlink(path)
            if self._index.pop(key, None) is not None:
                self._ledger.drop(key)  # a key being rewritten keeps its reservation

    # -- helpers ----------------------------------------------------------------------------

    def _lookup(self, key: ChunkKey, out: memoryview) -> memoryview | None:
        """``out`` as bytes if ``key`` is stored (now most recent), ``None`` if absent."""
        _check_key(key)
        view = _byte_view(out)
        if view.readonly:
            raise InvalidArgument("read_into needs a writable output buffer")
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            if entry.length != len(view):
                raise InvalidArgument(
                    f"output buffer is {len(view)} bytes but chunk {key.hex()} has {entry.length}"
                )
            self._index.move_to_end(key)
        return view

    def _path_of(self, key: ChunkKey) -> str:
        name = key.hex()
        return f"{self._chunks_dir}/{name[:2]}/{name}.kv"

    def _file_bytes(self, length: int) -> int:
        return align_up(BLOCK + length) if self._o_direct else BLOCK + length


def _payload(key: ChunkKey, data: Buffer) -> memoryview:
    _check_key(key)
    return _byte_view(data)


def _check_key(key: ChunkKey) -> None:
    if not isinstance(key, bytes) or len(key) != CHUNK_KEY_BYTES:
        shown = len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise InvalidArgument(f"chunk key must be {CHUNK_KEY_BYTES} bytes, got {shown}")


def _byte_view(buf: Buffer) -> memoryview:
    view = memoryview(buf)
    if not view.c_contiguous:
        raise InvalidArgument("chunk buffers must be contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _raise(error: TierError) -> bool:
    raise error

"""The client's side of the shared-memory lookup index: ``IndexReader``, a read-only
mapping of one tenant's table (the format, the writer and the ordering argument are in
``shm.lookup_index``).

``lookup`` answers how many leading chunks of a request the first tier holds;
``locate`` and ``unchanged`` serve loads without a lease: where each chunk's bytes are in
the arena, and afterwards whether each kept its entry while it was copied. Every read is a
sequence-lock read (retried while the writer is mid-change); a table whose server is hung
(its heartbeat stale) or stopped (marked closed) answers nothing, and one whose server is
gone (its lock free) locates nothing (its lookups stop with the client's session).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lmcache_svc.errors import InvalidArgument
from lmcache_svc.results import LookupResult, Placement
from lmcache_svc.shm.arena import SHM_DIR, check_segment_name
from lmcache_svc.shm.lookup_index import (
    FLAG_CLOSED,
    FLAG_INCOMPLETE,
    FLAG_LOWER_TIERS,
    HEADER_BYTES,
    INDEX_TRANSPORT,
    MAGIC,
    MAX_READ_TRIES,
    SLOT_WORDS,
    STALE_NS,
    TENANT_MAX_BYTES,
    TENANT_OFFSET,
    TIER_MAX_BYTES,
    TIER_OFFSET,
    W_BEAT,
    W_FLAGS,
    W_MAGIC,
    W_SEQ,
    W_SLOTS,
    get_medium,
    get_text,
    location_offset,
    namespace_check_word,
    namespace_word,
    segment_bytes,
    unsupported_cpu_reason,
)
from lmcache_svc.tiers.base import Medium

log = logging.getLogger(__name__)
_TWO_WORDS = struct.Struct("<QQ")


@dataclass(frozen=True, slots=True)
class IndexAnswer:
    """Leading chunks found; ``final`` False: a shorter answer than asked may be wrong.
    ``located``: where the found ones are (a location word of 0: not in the arena)."""

    num_hit_chunks: int
    final: bool
    located: Located


@dataclass(frozen=True, slots=True)
class Located:
    """Where the leading chunks of a request are in the arena (``IndexReader.locate``):
    the chunks (their namespace and hashes), their location words, and the table's
    sequence counter when read."""

    seq: int
    namespace_id: bytes
    chunk_hashes: Sequence[bytes]
    locations: list[int]

    @property
    def offsets(self) -> list[int]:
        return [location_offset(w) for w in self.locations]


class IndexReader:
    """A client's read-only mapping of one tenant's table. Thread-safe (reads only)."""

    def __init__(
        self, mm: mmap.mmap, fd: int, nonce: bytes, tenant: str, tier_name: str, medium: Medium
    ) -> None:
        self._mm = mm
        self.nonce = nonce  # which table this is (a restarted server's has another)
        self._fd: int | None = fd  # to ask whether the server still holds its lock
        self._close_fd = weakref.finalize(self, os.close, fd)  # a dropped session's reader
        self._words = memoryview(mm).cast("Q")
        self.num_slots = self._words[W_SLOTS]
        self._slots = self._words[HEADER_BYTES // 8 :]
        self._mask = self.num_slots - 1
        self.tenant = tenant
        self.tier_name = tier_name
        self.medium = medium

    @classmethod
    def open(cls, name: str, size: int, nonce: bytes) -> IndexReader | None:
        """Map ``/dev/shm/<name>`` read-only; None when it is missing, of another size or
        not the table whose nonce the session announced (e.g. a server on another host)."""
        try:
            path = os.path.join(SHM_DIR, check_segment_name(name))
        except InvalidArgument:
            return None
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            if size <= HEADER_BYTES or os.fstat(fd).st_size != size:
                return None
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError:
            os.close(fd)
            return None
        buf = memoryview(mm)
        words = buf.cast("Q")
        ok = (
            words[W_MAGIC] == MAGIC
            and bytes(buf[8:24]) == bytes(nonce)
            and segment_bytes(words[W_SLOTS]) == size
            and words[W_SLOTS] & (words[W_SLOTS] - 1) == 0
        )
        tenant = get_text(buf, TENANT_OFFSET, TENANT_MAX_BYTES) if ok else None
        tier = get_text(buf, TIER_OFFSET, TIER_MAX_BYTES) if ok else None
        medium = get_medium(buf) if ok else None
        words.release()
        buf.release()
        if tenant is None or tier is None or medium is None:
            mm.close()
            os.close(fd)
            return None
        return cls(mm, fd, bytes(nonce), tenant, tier, medium)

    @property
    def closed(self) -> bool:
        return self._fd is None or bool(self._words[W_FLAGS] & FLAG_CLOSED)

    def _server_alive(self) -> bool:
        """Whether the server still holds the segment's lock (it does for its lifetime; a
        killed server never marks its table closed). One failing ``flock`` call."""
        fd = self._fd
        if fd is None:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True  # the server's exclusive lock: alive
        except OSError:
            return False
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False

    def _fresh(self) -> bool:
        """The server stamped the table lately (a hung one's is not read). No system call."""
        return time.monotonic_ns() - self._words[W_BEAT] <= STALE_NS

    def _usable(self) -> bool:
        """The server is alive and stamps the table (a hung or killed one's is not read)."""
        return self._fresh() and self._server_alive()

    def _probe(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> list[int]:
        """The location words of the leading chunks found; a reader's probes, to be made
        inside a sequence-lock read. Each chunk's key words, as ``fingerprint`` and
        ``check_word`` make them, are made here too, both from one call, in one loop with
        its probe: this runs per chunk of every lookup (47 chunks cold: 140 us with a call
        per chunk's key and one per probe, 95 without; numpy's calls took 270-290)."""
        word, check = namespace_word(namespace_id), namespace_check_word(namespace_id)
        slots, mask, probes = self._slots, self._mask, range(self.num_slots)
        unpack = _TWO_WORDS.unpack_from
        found: list[int] = []
        for chunk_hash in chunk_hashes:
            w0, w1 = unpack(chunk_hash)
            fp, key_check = (w0 ^ word) or 1, w1 ^ check
            i = fp & mask
            for _ in probes:
                j = SLOT_WORDS * i
                slot_word = slots[j]
                if slot_word == fp and slots[j + 1] == key_check:
                    found.append(slots[j + 2])
                    break
                if slot_word == 0:
                    return found
                i = (i + 1) & mask
            else:  # a full table without it
                return found
        return found

    def _read(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes]
    ) -> tuple[int, int, list[int]] | None:
        """One consistent read of the leading chunks found: (sequence counter, flags, their
        location words); None when the table is closed or kept changing under the reads."""
        words = self._words
        for _ in range(MAX_READ_TRIES):
            seq = words[W_SEQ]
            if seq & 1:
                os.sched_yield()  # the writer is mid-change: let it finish
                continue
            flags = words[W_FLAGS]
            if flags & FLAG_CLOSED:
                return None
            found = self._probe(namespace_id, chunk_hashes)
            if words[W_SEQ] == seq:
                return seq, flags, found
        return None

    def placed(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], placement: Placement
    ) -> Located | None:
        """``locate``'s answer from a placement read earlier from this table (by a lookup,
        maybe in another process), without reading the table's entries: ``unchanged``
        after the copy tells whether the chunks kept those places. None when the placement
        is another table's, of other chunks' number, or names a chunk outside the arena,
        or when the table is not to be read now (its server gone, hung or stopped: as
        ``locate``, so a load from a server killed since the lookup is not read in place)."""
        locations = placement.locations
        if (
            placement.nonce != self.nonce
            or len(locations) != len(chunk_hashes)
            or not all(locations)
            or not self._usable()
        ):
            return None
        return Located(placement.seq, namespace_id, chunk_hashes, list(locations))

    def lookup(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> IndexAnswer | None:
        """Leading chunks of the namespace indexed; None when the table is stale, closed or
        kept changing under the reads (the caller asks the server).

        A lookup does not ask whether the server still holds the segment's lock (the
        system call, and the exception that says "held", took about 50 us of a cold
        lookup's 160): a killed server ends its clients' sessions, after which they do not
        read its tables (``CacheClient.lookup_local``), and an answer given in between only
        plans a load, which ``placed`` and ``locate`` refuse (the load is then leased,
        fails, and is recomputed)."""
        if not self._fresh():
            return None
        read = self._read(namespace_id, chunk_hashes)
        if read is None:
            return None
        seq, flags, found = read
        num = len(found)
        final = num == len(chunk_hashes) or not flags & (FLAG_LOWER_TIERS | FLAG_INCOMPLETE)
        return IndexAnswer(num, final, Located(seq, namespace_id, chunk_hashes[:num], found))

    def locate(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> Located | None:
        """Where every one of the chunks is in the arena, for a load without a lease; None
        unless all of them are indexed with a location, or when the table is not to be read
        (stale, its server gone) or cannot be now."""
        if not self._usable():
            return None
        read = self._read(namespace_id, chunk_hashes)
        if read is None:
            return None
        seq, _, locations = read
        if len(locations) < len(chunk_hashes) or not all(locations):
            return None
        return Located(seq, namespace_id, chunk_hashes, locations)

    def unchanged(self, located: Located) -> int:
        """After copying located chunks: how many leading ones still have the entry they
        were located by (their bytes were not freed or rewritten during the copy)."""
        if self._words[W_SEQ] == located.seq:
            return len(located.locations)  # the table did not change at all
        read = self._read(located.namespace_id, located.chunk_hashes)
        if read is None:
            return 0
        num = 0
        for now, then in zip(read[2], located.locations):
            if now != then:
                break
            num += 1
        return num

    def close(self) -> None:
        self._fd = None
        self._close_fd()


def open_index_segments(segments: Iterable[object]) -> dict[str, IndexReader]:
    """The index segments of a session's first event that map here, by tenant; none on a
    CPU the index's ordering argument does not hold for (``unsupported_cpu_reason``)."""
    readers: dict[str, IndexReader] = {}
    offered = [seg for seg in segments if getattr(seg, "transport", None) == INDEX_TRANSPORT]
    reason = unsupported_cpu_reason() if offered else None
    if reason is not None:
        log.warning("lookup index not mapped (%s); lookups go to the server over gRPC", reason)
        return readers
    for seg in offered:
        reader = IndexReader.open(seg.name, seg.size, seg.nonce)  # type: ignore[attr-defined]
        if reader is not None:
            readers[reader.tenant] = reader
    return readers


def answer_locally(
    readers: dict[str, IndexReader],
    tenant: str,
    namespace_id: bytes,
    chunk_hashes: Sequence[bytes],
) -> LookupResult | None:
    """``Lookup``'s answer (the leading chunks held, all in the first tier, with the tier's
    name and medium from the table's header) from the tenant's table, or None when the table
    cannot give it (none mapped, closed, busy, or a miss that may be a hit in a lower tier or
    an overflowed table) or a hash is malformed (the server answers that with its error)."""
    reader = readers.get(tenant)
    if reader is None or any(len(h) != 32 for h in chunk_hashes):
        return None
    answer = reader.lookup(namespace_id, chunk_hashes)
    if answer is None or not answer.final:
        return None
    num, located = answer.num_hit_chunks, answer.located
    placement = Placement(reader.nonce, located.seq, tuple(located.locations))
    return LookupResult(num, [reader.tier_name] * num, [reader.medium] * num, placement)

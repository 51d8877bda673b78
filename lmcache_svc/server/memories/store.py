"""The service's named KV memories: tenant-scoped, capacity-bounded, optionally persistent.

A memory is one safetensors blob (``format.py``) named by the UUID in its header. Each tenant
sees only its own memories; ids may repeat across tenants. Capacity counts whole blobs across
all tenants and is never exceeded: a put that does not fit is ``NoSpace`` (memories are
never evicted, they are deleted by their owners). Storing the same bytes (same size and
xxh3-64) under a stored id again is a no-op; other bytes under it are a ``Conflict``.

Reads are verified and streamed (``open``: ``integrity.MemoryRead``): a memory whose bytes
changed at rest is refused with ``MemoryCorrupted``, its file quarantined and counted
(``MemoryUsage.num_corrupted``). At most ``max_transfers`` reads (and uploads, which the
transports register with ``transfer``) are in flight; one more is ``TooBusy``.

Thread-safe. One lock guards the index and the byte count, and is never held across disk
I/O: a put or delete first claims its (tenant, id) (a put or delete of the same id meanwhile
waits its turn, in its own thread), writes or removes the file without the lock (fsync
included), then publishes the result under it, so a list or a read never waits behind a
write's fsync. A memory being written is not listed until it is stored; its bytes count
against capacity from the start.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lmcache_svc.errors import Conflict, InvalidArgument, NoSpace, PayloadTooLarge
from lmcache_svc.memory_blob import MemoryInfo, check_memory_id, parse_memory
from lmcache_svc.server.memories.blobs import Blobs, DirBlobs, RamBlobs
from lmcache_svc.server.memories.integrity import CHECK_PIECE_BYTES, MemoryRead, blob_checksum
from lmcache_svc.server.memories.transfers import DEFAULT_MAX_TRANSFERS, TransferLimiter
from lmcache_svc.tiers.base import Buffer

log = logging.getLogger(__name__)

MAX_TENANT_CHARS = 256


@dataclass(frozen=True, slots=True)
class MemoryUsage:
    num_memories: int
    used_bytes: int
    capacity_bytes: int
    num_corrupted: int = 0
    """Memories refused since start-up because their bytes changed at rest (quarantined)."""
    num_skipped_files: int = 0
    """Files the start-up scan found that are not memories (left in place)."""


@dataclass(frozen=True, slots=True)
class _Entry:
    info: MemoryInfo
    checksum: int


class MemoryStore:
    def __init__(
        self,
        *,
        capacity_bytes: int,
        max_bytes: int,
        path: Path | None = None,
        max_transfers: int = DEFAULT_MAX_TRANSFERS,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.max_bytes = max_bytes
        self.path = path
        self._blobs: Blobs = DirBlobs(path) if path is not None else RamBlobs()
        self._transfers = TransferLimiter(max_transfers)
        self._index: dict[str, dict[str, _Entry]] = {}
        self._busy: set[tuple[str, str]] = set()
        self._used = 0
        self._num_corrupted = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._load()

    def _load(self) -> None:
        for found in self._blobs.scan():
            self._index.setdefault(found.tenant, {})[found.info.memory_id] = _Entry(
                found.info, found.checksum
            )
            self._used += found.info.size_bytes
        if self.path is not None:
            log.info(
                "memories: %d (%d bytes) found under %s",
                self.usage().num_memories,
                self._used,
                self.path,
            )
        if self._used > self.capacity_bytes:
            log.warning(
                "memories: %d bytes stored, over memory.capacity (%d): new puts are refused "
                "until some are deleted",
                self._used,
                self.capacity_bytes,
            )

    # -- writes ----------------------------------------------------------------------------

    def put(self, tenant: str, blob: Buffer) -> tuple[MemoryInfo, bool]:
        """Store ``blob``; (its info, True) when stored now, (info, False) when it already was."""
        _check_tenant(tenant)
        size = memoryview(blob).nbytes
        if size > self.max_bytes:
            raise PayloadTooLarge(
                f"memory of {size} bytes is over memory.max_bytes ({self.max_bytes})"
            )
        info = parse_memory(blob)
        checksum = blob_checksum(blob)
        mid = info.memory_id
        with self._lock:
            self._wait_idle(tenant, mid)
            stored = self._index.get(tenant, {}).get(mid)
            if stored is not None:
                if (stored.info.size_bytes, stored.checksum) == (size, checksum):
                    return stored.info, False
                raise Conflict(
                    f"memory {mid} is already stored with other bytes; delete it first or use "
                    "a new id"
                )
            if self._used + size > self.capacity_bytes:
                raise NoSpace(
                    f"no room for a memory of {size} bytes: {self._used} of "
                    f"{self.capacity_bytes} bytes (memory.capacity) are used; delete memories"
                )
            self._busy.add((tenant, mid))
            self._used += size
        stored_now = False
        try:
            self._blobs.write(tenant, mid, blob, checksum)
            stored_now = True
        finally:
            with self._lock:
                if stored_now:
                    self._index.setdefault(tenant, {})[mid] = _Entry(info, checksum)
                else:
                    self._used -= size
                self._release(tenant, mid)
        return info, True

    def delete(self, tenant: str, memory_id: str) -> bool:
        """Delete a memory; False when the tenant had none by that id."""
        _check_tenant(tenant)
        check_memory_id(memory_id)
        with self._lock:
            self._wait_idle(tenant, memory_id)
            entry = self._index.get(tenant, {}).get(memory_id)
            if entry is None:
                return False
            self._busy.add((tenant, memory_id))
        removed = False
        try:
            self._blobs.remove(tenant, memory_id, entry.checksum)
            removed = True
        finally:
            with self._lock:
                if removed:
                    self._drop(tenant, entry)
                self._release(tenant, memory_id)
        return True

    def _wait_idle(self, tenant: str, memory_id: str) -> None:
        """Wait (lock held, released meanwhile) until no other call writes or deletes the
        id: puts and deletes of one id take turns, as if the disk I/O were under the lock,
        while lists and reads never wait for them."""
        while (tenant, memory_id) in self._busy:
            self._idle.wait()

    def _release(self, tenant: str, memory_id: str) -> None:
        """The id's write or delete is over (lock held)."""
        self._busy.discard((tenant, memory_id))
        self._idle.notify_all()

    def _drop(self, tenant: str, entry: _Entry) -> bool:
        """Remove ``entry`` from the index if it is still there (lock held)."""
        found = self._index.get(tenant, {})
        if found.get(entry.info.memory_id) is not entry:
            return False
        del found[entry.info.memory_id]
        if not found:
            del self._index[tenant]
        self._used -= entry.info.size_bytes
        return True

    # -- reads -----------------------------------------------------------------------------

    def info(self, tenant: str, memory_id: str) -> MemoryInfo | None:
        entry = self._entry(tenant, memory_id)
        return None if entry is None else entry.info

    def _entry(self, tenant: str, memory_id: str) -> _Entry | None:
        _check_tenant(tenant)
        check_memory_id(memory_id)
        with self._lock:
            return self._index.get(tenant, {}).get(memory_id)

    def open(self, tenant: str, memory_id: str) -> MemoryRead | None:
        """A verified read of the memory (``MemoryCorrupted`` if its bytes changed at rest),
        or None when the tenant has none; ``TooBusy`` over ``max_transfers``. The caller
        closes it."""
        entry = self._entry(tenant, memory_id)
        if entry is None:
            return None
        release = self._transfers.acquire(f"a read of memory {memory_id}")
        try:
            file = self._blobs.open(tenant, memory_id, entry.checksum)
        except BaseException:
            release()
            raise
        if file is None:  # deleted since the lookup
            release()
            return None
        read = MemoryRead(
            file,
            entry.info,
            entry.checksum,
            on_mismatch=lambda: self._quarantine(tenant, entry),
            release=release,
        )
        try:
            read.verify()
        except BaseException:
            read.close()
            raise
        return read

    def get(self, tenant: str, memory_id: str) -> bytes | None:
        """The whole blob (verified), or None when the tenant has no such memory."""
        read = self.open(tenant, memory_id)
        if read is None:
            return None
        with read:
            return b"".join(read.pieces(CHECK_PIECE_BYTES))

    def transfer(self, what: str) -> Callable[[], None]:
        """Count an upload as a transfer in flight (``TooBusy`` over the limit); returns the
        release to call when it is done."""
        return self._transfers.acquire(what)

    def _quarantine(self, tenant: str, entry: _Entry) -> str:
        """A read found the memory's bytes changed: stop serving it, move its file aside."""
        mid = entry.info.memory_id
        with self._lock:
            if not self._drop(tenant, entry):
                return "it was deleted or replaced meanwhile"
            self._num_corrupted += 1
            busy = (tenant, mid) in self._busy
            self._busy.add((tenant, mid))
        try:
            where = (
                "its file is being deleted"
                if busy
                else self._blobs.quarantine(tenant, mid, entry.checksum)
            )
        finally:
            if not busy:
                with self._lock:
                    self._release(tenant, mid)
        log.error("memory %s of tenant %r failed its checksum: %s", mid, tenant, where)
        return where

    def list(self, tenant: str) -> list[MemoryInfo]:
        """The tenant's memories, ordered by id."""
        _check_tenant(tenant)
        with self._lock:
            found = self._index.get(tenant, {})
            return [found[k].info for k in sorted(found)]

    def usage(self) -> MemoryUsage:
        with self._lock:
            num = sum(len(m) for m in self._index.values())
            return MemoryUsage(
                num,
                self._used,
                self.capacity_bytes,
                self._num_corrupted,
                self._blobs.num_skipped,
            )


def _check_tenant(tenant: str) -> None:
    if not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_CHARS:
        raise InvalidArgument(
            f"tenant must be a non-empty string of at most {MAX_TENANT_CHARS} characters"
        )

"""The service's named KV memories: tenant-scoped, capacity-bounded, optionally persistent.

A memory is one safetensors blob (``memory_blob.py``) named by the UUID in its header. Each tenant
sees only its own memories; ids may repeat across tenants. Capacity counts whole blobs across
all tenants and is never exceeded: a put that does not fit is ``NoSpace`` (memories are
never evicted, they are deleted by their owners). Storing the same bytes under a stored id
again is a no-op; other bytes under it are a ``Conflict``. Thread-safe: one lock orders
puts and deletes (a put's disk write happens under it; memories are written rarely), reads
copy the blob outside it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from lmcache_svc.errors import Conflict, InvalidArgument, NoSpace, PayloadTooLarge
from lmcache_svc.memory_blob import MemoryInfo, check_memory_id, parse_memory
from lmcache_svc.server.memories.blobs import Blobs, DirBlobs, RamBlobs

log = logging.getLogger(__name__)

MAX_TENANT_CHARS = 256


@dataclass(frozen=True, slots=True)
class MemoryUsage:
    num_memories: int
    used_bytes: int
    capacity_bytes: int


class MemoryStore:
    def __init__(self, *, capacity_bytes: int, max_bytes: int, path: Path | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.max_bytes = max_bytes
        self.path = path
        self._blobs: Blobs = DirBlobs(path) if path is not None else RamBlobs()
        self._index: dict[str, dict[str, MemoryInfo]] = {}
        self._used = 0
        self._lock = threading.Lock()
        self._load()

    def _load(self) -> None:
        for tenant, info in self._blobs.scan():
            self._index.setdefault(tenant, {})[info.memory_id] = info
            self._used += info.size_bytes
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

    def put(self, tenant: str, blob: bytes | bytearray) -> tuple[MemoryInfo, bool]:
        """Store ``blob``; (its info, True) when stored now, (info, False) when it already was."""
        _check_tenant(tenant)
        if len(blob) > self.max_bytes:
            raise PayloadTooLarge(
                f"memory of {len(blob)} bytes is over memory.max_bytes ({self.max_bytes})"
            )
        info = parse_memory(blob)
        with self._lock:
            stored = self._index.get(tenant, {}).get(info.memory_id)
            if stored is not None:
                if self._holds(tenant, stored, blob):
                    return stored, False
                raise Conflict(
                    f"memory {info.memory_id} is already stored with other bytes; delete it "
                    "first or use a new id"
                )
            if self._used + len(blob) > self.capacity_bytes:
                raise NoSpace(
                    f"no room for a memory of {len(blob)} bytes: {self._used} of "
                    f"{self.capacity_bytes} bytes (memory.capacity) are used; delete memories"
                )
            self._blobs.write(tenant, info.memory_id, bytes(blob))
            self._index.setdefault(tenant, {})[info.memory_id] = info
            self._used += len(blob)
        return info, True

    def _holds(self, tenant: str, stored: MemoryInfo, blob: bytes | bytearray) -> bool:
        if stored.size_bytes != len(blob):
            return False
        return self._blobs.read(tenant, stored.memory_id) == blob

    def info(self, tenant: str, memory_id: str) -> MemoryInfo | None:
        _check_tenant(tenant)
        check_memory_id(memory_id)
        with self._lock:
            return self._index.get(tenant, {}).get(memory_id)

    def get(self, tenant: str, memory_id: str) -> bytes | None:
        """The blob, or None when the tenant has no such memory."""
        if self.info(tenant, memory_id) is None:
            return None
        return self._blobs.read(tenant, memory_id)

    def list(self, tenant: str) -> list[MemoryInfo]:
        """The tenant's memories, ordered by id."""
        _check_tenant(tenant)
        with self._lock:
            found = self._index.get(tenant, {})
            return [found[k] for k in sorted(found)]

    def delete(self, tenant: str, memory_id: str) -> bool:
        """Delete a memory; False when the tenant had none by that id."""
        _check_tenant(tenant)
        check_memory_id(memory_id)
        with self._lock:
            found = self._index.get(tenant, {})
            info = found.get(memory_id)
            if info is None:
                return False
            self._blobs.remove(tenant, memory_id)
            del found[memory_id]
            if not found:
                del self._index[tenant]
            self._used -= info.size_bytes
        return True

    def usage(self) -> MemoryUsage:
        with self._lock:
            num = sum(len(m) for m in self._index.values())
            return MemoryUsage(num, self._used, self.capacity_bytes)


def _check_tenant(tenant: str) -> None:
    if not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_CHARS:
        raise InvalidArgument(
            f"tenant must be a non-empty string of at most {MAX_TENANT_CHARS} characters"
        )

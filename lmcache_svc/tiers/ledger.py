"""``SizeLedger``: the bytes a tier has counted per chunk, against its capacity.

For tiers that must count what they hold against a capacity (Redis, SSD): a put reserves its
size before writing and gives it back if the write fails, a read that finds a chunk missing
drops it, and a start-up scan records what is there.
Thread-safe; knows nothing of the medium.
"""

from __future__ import annotations

import threading

from lmcache_svc.keys import ChunkKey


class SizeLedger:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._sizes: dict[ChunkKey, int] = {}
        self._used = 0

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    @property
    def num_chunks(self) -> int:
        with self._lock:
            return len(self._sizes)

    def reserve(self, key: ChunkKey, size: int) -> tuple[bool, int | None]:
        """Count ``size`` bytes for ``key`` if they fit; returns (fits, the previous size)."""
        with self._lock:
            old = self._sizes.get(key)
            if self._used - (old or 0) + size > self.capacity_bytes:
                return False, old
            self._sizes[key] = size
            self._used += size - (old or 0)
            return True, old

    def unreserve(self, key: ChunkKey, size: int, old: int | None) -> None:
        """Undo ``reserve(key, size)`` that answered ``old``, unless the key changed since."""
        with self._lock:
            if self._sizes.get(key) != size:
                return  # someone else changed it meanwhile: theirs is newer
            self._used += (old or 0) - size
            if old is None:
                del self._sizes[key]
            else:
                self._sizes[key] = old

    def record(self, key: ChunkKey, size: int) -> None:
        """Count ``key`` as holding ``size`` bytes (found on the medium)."""
        with self._lock:
            self._used += size - self._sizes.get(key, 0)
            self._sizes[key] = size

    def drop(self, key: ChunkKey) -> None:
        """Stop counting ``key`` (deleted, expired or evicted)."""
        with self._lock:
            self._used -= self._sizes.pop(key, 0)

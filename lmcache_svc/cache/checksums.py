"""xxh3-64 checksums of the first tier's committed chunks, kept by slot.

Taken off the request path, in the background, shortly after a chunk is committed or
promoted (``bench.checksum`` measured xxh3 at 0.3-0.5x the time of a memcpy of the same
bytes: docs/architecture.md, "Chunk checksums"); checked before a chunk leaves the arena
(demotion, write-through) and when a load or get asks ``verify``. A chunk whose checksum is
not taken yet has none: ``check`` answers None, and the caller records one instead.

One 8-byte word per 4096-byte page of the segment, indexed by the slot's first page (slots
are page-aligned): 2 MiB per GiB of arena, and no per-chunk object in the chunk index,
whose size ``bench scale`` watches. 0 means "none"; a stored checksum has its low bit set.

Not locked: the cache's lock guards ``record``/``clear`` against slot reuse (the chunk is
pinned while its bytes are hashed).
"""

from __future__ import annotations

import numpy as np
import xxhash

from lmcache_svc.shm.slab import ALIGN
from lmcache_svc.tiers.base import Buffer, Slot


def checksum(data: Buffer) -> int:
    """The stored form of a chunk's xxh3-64 (low bit set, so it is never 0)."""
    return xxhash.xxh3_64_intdigest(data) | 1


class SlotChecksums:
    def __init__(self, segment_bytes: int) -> None:
        self._sums = np.zeros(segment_bytes // ALIGN + 1, dtype=np.uint64)

    def record(self, slot: Slot, value: int) -> None:
        self._sums[slot.offset // ALIGN] = value

    def clear(self, slot: Slot) -> None:
        self._sums[slot.offset // ALIGN] = 0

    def stored(self, slot: Slot) -> int | None:
        value = int(self._sums[slot.offset // ALIGN])
        return value or None

    def check(self, slot: Slot, data: Buffer) -> bool | None:
        """True when ``data`` matches the slot's checksum, None when it has none yet."""
        value = self.stored(slot)
        return None if value is None else checksum(data) == value

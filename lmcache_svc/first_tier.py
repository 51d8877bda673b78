"""The first tier with its chunk index: slots in and out, and chunk moves across tiers.

Allocating a slot (evicting to make room), freeing one, dropping a pin, and the three moves
between the first tier and the lower ones: demotion of evicted chunks, promotion of chunks
found only below (for a load), and write-through copies of committed chunks. Bulk copies
run outside the lock, on entries that are pinned or detached from the index meanwhile.

Locking: shares the cache's (reentrant) lock. ``allocate``, ``evict``, ``promote`` and
``copy_through`` take it themselves and must be called without it (they copy bulk bytes
outside it); ``free`` and ``unpin`` assume the caller holds it.
"""

from __future__ import annotations

import threading

from lmcache_svc.chunk_index import ChunkIndex
from lmcache_svc.keys import ChunkKey
from lmcache_svc.lower import LowerTier, LowerTiers
from lmcache_svc.metrics import Metrics
from lmcache_svc.tiers.base import Slot, SlotTier


class FirstTier:
    def __init__(
        self,
        tier: SlotTier,
        index: ChunkIndex,
        lower: LowerTiers,
        lock: threading.RLock,
        metrics: Metrics,
    ) -> None:
        self._tier = tier
        self._index = index
        self._lower = lower
        self._lock = lock
        self._metrics = metrics

    def allocate(
        self, key: ChunkKey, nbytes: int, owner: str | None, deadline: float
    ) -> Slot | None:
        """A not-ready entry for ``key`` with a fresh slot, evicting to make room."""
        while True:
            with self._lock:
                if self._index.busy(key):
                    return None
                slot = self._tier.allocate(key, nbytes)
                if slot is not None:
                    self._index.reserve(key, slot, owner, deadline)
                    return slot
            if not self.evict(nbytes):
                return None

    def evict(self, nbytes: int) -> int:
        """Evict least recently used unpinned chunks worth ``nbytes``; returns how many."""
        with self._lock:
            victims = self._index.least_recent_at_rest(nbytes)
            for key, _ in victims:
                self._index.remove(key)
                self._index.detached.add(key)
        for key, slot in victims:
            self._lower.demote(key, self._tier.view(slot))
        with self._lock:
            for key, _ in victims:
                self._index.detached.discard(key)
                self._tier.delete(key)
        self._metrics.evictions.labels(tier=self._tier.name).inc(len(victims))
        return len(victims)

    def promote(self, keys: list[ChunkKey], nbytes: int) -> tuple[list[ChunkKey], list[str]]:
        """Copy a contiguous run of chunks up from lower tiers; returns the pinned prefix."""
        with self._lock:
            num = next(
                (i for i, k in enumerate(keys) if self._index.busy(k)),
                len(keys),
            )
        reserved: list[tuple[ChunkKey, LowerTier, memoryview]] = []
        for key, source in zip(keys, self._lower.sources(keys[:num])):
            slot = self.allocate(key, nbytes, owner="promotion", deadline=float("inf"))
            if slot is None:
                break
            reserved.append((key, source, self._tier.view(slot)))
        try:
            ok = self._lower.read_up(reserved)
        except BaseException:
            with self._lock:
                for key, _, _ in reserved:
                    self.free(key)
            raise
        pinned: list[ChunkKey] = []
        sources: list[str] = []
        contiguous = True
        with self._lock:
            for (key, source, _), good in zip(reserved, ok):
                contiguous = contiguous and good
                if not good:
                    self.free(key)
                    continue
                entry = self._index.entry(key)
                if entry is None:
                    raise RuntimeError(f"promoted chunk {key.hex()} lost its reservation")
                if contiguous:  # later chunks stay promoted, but only a prefix is leased
                    entry.pins += 1
                    pinned.append(key)
                    sources.append(source.tier.name)
                self._index.mark_ready(key, entry)
                self._metrics.promotions.labels(tier=self._tier.name).inc()
        return pinned, sources

    def copy_through(self, keys: list[ChunkKey]) -> None:
        """Copy committed chunks to the write-through tiers (runs on the background thread)."""
        with self._lock:
            pinned = [k for k in keys if self._index.readable(k)]
            for key in pinned:
                self._index.pin(key)
            slots = [self._index.slot_of(k) for k in pinned]
        try:
            self._lower.copy_through([(k, self._tier.view(s)) for k, s in zip(pinned, slots)])
        finally:
            with self._lock:
                for key in pinned:
                    self.unpin(key)

    def unpin(self, key: ChunkKey) -> None:
        """Drop one pin, freeing a chunk deleted while pinned (caller holds the lock)."""
        entry = self._index.entry(key)
        if entry is None or entry.pins <= 0:
            raise RuntimeError(f"unpin of chunk {key.hex()} that is not pinned")
        entry.pins -= 1
        if entry.pins == 0 and entry.doomed:
            self.free(key)
        else:
            self._index.settle(key, entry)

    def free(self, key: ChunkKey) -> None:
        """Drop a first-tier entry and its slot (caller holds the lock)."""
        self._index.remove(key)
        self._tier.delete(key)

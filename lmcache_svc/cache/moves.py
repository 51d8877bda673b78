"""Chunk moves between the first tier and the lower ones, and the checks on their bytes.

Three moves: demotion of evicted chunks (``evict``), promotion of chunks found only below
(``promote``, for a load) and write-through copies of committed chunks (``copy_through``).
Bulk copies run outside the cache's lock, on chunks that are pinned, or removed from the
index for demotion, meanwhile. Every change to the first tier's index goes through
``FirstTierSlots``, its owner; this module only decides what moves.

Checksums (``checksums.py``, when enabled): taken in the background after a commit or a
promotion (``record_checksums``, paced: see background_queue.py), or by a write-through
copy or a verified load that finds none, checked before bytes leave the arena (demotion,
write-through) and on a verified load (``verified_prefix``). A chunk that fails is dropped
and counted (``tier_errors{kind="corrupted"}``), never handed on.

Locking: every method takes the cache's lock itself, briefly, and must be called without it
(it copies bulk bytes and calls the lower tiers outside it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from lmcache_svc.cache.checksums import checksum
from lmcache_svc.cache.first_tier_slots import FirstTierSlots
from lmcache_svc.cache.lower_tier_manager import LowerTierManager, LowerTierState
from lmcache_svc.keys import ChunkKey
from lmcache_svc.metrics import Metrics
from lmcache_svc.tiers.base import Slot, SlotTier

log = logging.getLogger(__name__)

STAGING_BYTES = 64 << 20
"""Most bytes a promotion reads ahead into staging buffers before it makes room for them."""


class ChunkMoves:
    def __init__(
        self,
        tier: SlotTier,
        slots: FirstTierSlots,
        lower: LowerTierManager,
        lock: threading.RLock,
        metrics: Metrics,
    ) -> None:
        self._tier = tier
        self._slots = slots
        self._lower = lower
        self._lock = lock
        self._metrics = metrics

    def allocate(
        self,
        key: ChunkKey,
        nbytes: int,
        owner: str | None,
        deadline: float,
        tenant: str | None = None,
        *,
        evict: bool = True,
    ) -> Slot | None:
        """A not-ready entry for ``key`` with a fresh slot (counted against ``tenant``, when
        given), evicting to make room unless told not to."""
        while True:
            with self._lock:
                if self._slots.busy(key):
                    return None
                slot = self._slots.reserve(key, nbytes, owner, deadline, tenant)
                if slot is not None:
                    return slot
            if not evict or not self.evict(nbytes):
                return None

    def evict(self, nbytes: int) -> int:
        """Evict least recently used unpinned chunks worth ``nbytes``; returns how many."""
        with self._lock:
            victims = self._slots.take_for_demotion(nbytes)
            since = self._lower.delete_count()  # a delete from here on undoes the demotion
        for key, slot in victims:
            view = self._tier.view(slot)
            if self._intact(key, slot, view):
                self._lower.demote(key, view, since=since)
        self._slots.end_demotion(victims)
        self._metrics.evictions.labels(tier=self._tier.name).inc(len(victims))
        return len(victims)

    def promote(self, keys: list[ChunkKey], nbytes: int) -> tuple[list[ChunkKey], list[str]]:
        """Copy a contiguous run of chunks up from lower tiers; returns the pinned prefix.

        Chunks go straight into slots that are free now; only a chunk whose bytes are
        already in hand (read into a staging buffer, ``STAGING_BYTES`` at a time) may evict
        others to make room, so a read that fails (a tier that lost the chunk: a Redis that
        restarted empty) never costs the arena a chunk."""
        with self._lock:
            num = next(
                (i for i, k in enumerate(keys) if self._slots.busy(k)),
                len(keys),
            )
        plan = list(zip(keys, self._lower.sources(keys[:num])))
        in_place: list[tuple[ChunkKey, LowerTierState, memoryview]] = []
        for key, source in plan:
            slot = self.allocate(key, nbytes, "promotion", float("inf"), evict=False)
            if slot is None:
                break
            in_place.append((key, source, self._tier.view(slot)))
        pinned, sources, whole = self._read_up(in_place)
        if whole and len(in_place) < len(plan):
            more, more_from = self._promote_staged(plan[len(in_place) :], nbytes)
            pinned += more
            sources += more_from
        return pinned, sources

    def _read_up(
        self, reserved: list[tuple[ChunkKey, LowerTierState, memoryview]]
    ) -> tuple[list[ChunkKey], list[str], bool]:
        """Read promoted chunks into their reserved slots; (pinned prefix, its sources,
        whether every read succeeded). A failed one's slot is freed; later ones stay
        promoted, but only the prefix is leased."""
        try:
            ok = self._lower.read_up(reserved)
        except BaseException:
            self._slots.abort([key for key, _, _ in reserved])
            raise
        return (*self._commit_promoted(reserved, ok), all(ok))

    def _promote_staged(
        self, plan: list[tuple[ChunkKey, LowerTierState]], nbytes: int
    ) -> tuple[list[ChunkKey], list[str]]:
        """Promote chunks with no free slot: read them into staging buffers first, and
        allocate (evicting) only for those read; stop at the first that fails."""
        pinned: list[ChunkKey] = []
        sources: list[str] = []
        step = max(1, STAGING_BYTES // max(1, nbytes))
        for start in range(0, len(plan), step):
            staged = [(k, s, memoryview(bytearray(nbytes))) for k, s in plan[start : start + step]]
            ok = self._lower.read_up(staged)
            placed: list[tuple[ChunkKey, LowerTierState, memoryview]] = []
            for (key, source, data), good in zip(staged, ok):
                slot = self.allocate(key, nbytes, "promotion", float("inf")) if good else None
                if slot is None:
                    break
                view = self._tier.view(slot)
                view[:] = data
                placed.append((key, source, view))
            more, more_from = self._commit_promoted(placed, [True] * len(placed))
            pinned += more
            sources += more_from
            if len(placed) < len(staged):
                break
        return pinned, sources

    def _commit_promoted(
        self, reserved: list[tuple[ChunkKey, LowerTierState, memoryview]], ok: list[bool]
    ) -> tuple[list[ChunkKey], list[str]]:
        pinned: list[ChunkKey] = []
        sources: list[str] = []
        contiguous = True
        with self._lock:
            for (key, source, _), good in zip(reserved, ok):
                contiguous = contiguous and good
                if not good:
                    self._slots.free(key)
                    continue
                entry = self._slots.entry(key)
                if entry is None:
                    raise RuntimeError(f"promoted chunk {key.hex()} lost its reservation")
                # later chunks stay promoted, but only a prefix is leased
                self._slots.commit(key, entry, pin=contiguous, touch=False)
                if contiguous:
                    pinned.append(key)
                    sources.append(source.tier.name)
                self._metrics.promotions.labels(tier=self._tier.name).inc()
        return pinned, sources

    def copy_through(self, keys: list[ChunkKey]) -> None:
        """Copy committed chunks to the write-through tiers (runs on the background thread)."""
        pinned, slots = self._slots.pin_readable(keys)
        try:
            items = [(k, s, self._tier.view(s)) for k, s in zip(pinned, slots)]
            intact = [(k, v) for k, s, v in items if self._intact(k, s, v, condemn=True)]
            for _, slot, view in items:  # not taken yet (paced): from the bytes copied now
                self._record_missing(slot, view)
            self._lower.copy_through(intact)
        finally:
            self._slots.unpin_all(pinned)

    # -- checksums -------------------------------------------------------------------------

    def record_checksums(self, keys: Sequence[ChunkKey]) -> None:
        """Take the checksums of committed or promoted chunks (on a background thread)."""
        slots = self._slots
        if not slots.checksums_on:
            return
        pinned, taken = slots.pin_readable(keys)
        try:
            missing = [s for s in taken if slots.stored_checksum(s) is None]  # none on the way
            for slot in missing:
                slots.record_checksum(slot, checksum(self._tier.view(slot)))
        finally:
            slots.unpin_all(pinned)

    def verified_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many of ``keys`` (pinned) lead with intact bytes; the first chunk that fails
        is dropped (freed when its pins go). A chunk without a checksum gets one now."""
        for num, key in enumerate(keys):
            with self._lock:
                slot = self._slots.slot_of(key)
            view = self._tier.view(slot)
            if not self._intact(key, slot, view, condemn=True):
                return num
            self._record_missing(slot, view)
        return len(keys)

    def _record_missing(self, slot: Slot, view: memoryview) -> None:
        """Take the checksum of a pinned chunk that has none yet."""
        if self._slots.checksums_on and self._slots.stored_checksum(slot) is None:
            self._slots.record_checksum(slot, checksum(view))

    def _intact(self, key: ChunkKey, slot: Slot, view: memoryview, condemn: bool = False) -> bool:
        """False when the chunk's bytes differ from its checksum (counted; with ``condemn``,
        the chunk, pinned by the caller, is dropped when its last pin goes)."""
        if self._slots.check(slot, view) is not False:
            return True
        log.error("chunk %s in %s differs from its checksum: dropped", key.hex(), self._tier.name)
        self._metrics.tier_errors.labels(tier=self._tier.name, kind="corrupted").inc()
        if condemn:
            with self._lock:
                self._slots.condemn(key)
        return False

"""The first tier's slots and the chunk index over them: the one owner of the index.

``FirstTierSlots`` builds the cache's ``ChunkIndex`` and is the only code that changes it
(``tests/cache/test_structure.py`` checks that no other module calls the index's changing
methods): every other part of the cache reserves, commits, pins, frees, quarantines or
demotes a chunk by calling a method here. It also owns what is kept per slot: the arena's
checksums (``checksums.py``, when enabled), cleared whenever a slot is freed here.

Locking: the cache's lock (``CacheCore.lock``, passed in) guards the index; this module
never creates a lock. Methods documented "takes the lock" must be called without holding
any lock but the cache's (reentrant, so holding it is allowed); the rest expect the caller
to hold the cache's lock. Inside it, this code calls the first tier (its allocator has a lock
of its own, always taken after the cache's) and the index's ``on_change`` hook (the
lookup-index publisher, then the listener: both quick, neither calls back into the cache).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence

from lmcache_svc.cache.checksums import SlotChecksums
from lmcache_svc.cache.chunk_index import ChunkIndex, Entry
from lmcache_svc.keys import ChunkKey
from lmcache_svc.tiers.base import Buffer, Slot, SlotTier


class FirstTierSlots:
    def __init__(
        self,
        tier: SlotTier,
        lock: threading.RLock,
        on_change: Callable[[ChunkKey, bool], None] | None,
        *,
        checksums: bool = True,
    ) -> None:
        self._tier = tier
        self._lock = lock
        self._index = ChunkIndex(tier.slot_of, lock)
        self._index.on_change = on_change
        self._sums = SlotChecksums(tier.segment().size) if checksums else None
        # the hottest reads (every lookup, per chunk): the index's own methods, no extra call
        self.readable: Callable[[ChunkKey], bool] = self._index.readable
        """True for a committed chunk that is not being deleted."""
        self.busy: Callable[[ChunkKey], bool] = self._index.busy
        """True when ``key`` has an entry or is being demoted: no new slot for it now."""

    # -- reads (caller holds the lock) -----------------------------------------------------

    def entry(self, key: ChunkKey) -> Entry | None:
        return self._index.entry(key)

    def slot_of(self, key: ChunkKey) -> Slot:
        return self._index.slot_of(key)

    def pending(self) -> Iterator[tuple[ChunkKey, Entry]]:
        return self._index.pending()

    def quarantined_of(self, owner: str | None) -> list[ChunkKey]:
        return self._index.quarantined_of(owner)

    def owned_bytes(self, owner: str | None) -> int:
        return self._index.owned_bytes(owner)

    def tenant_bytes(self, tenant: str) -> int:
        return self._index.tenant_bytes(tenant)

    @property
    def num_pending(self) -> int:
        return self._index.num_pending

    @property
    def quarantined_bytes(self) -> int:
        return self._index.quarantined_bytes

    # -- reservations ----------------------------------------------------------------------

    def reserve(
        self, key: ChunkKey, nbytes: int, owner: str | None, deadline: float, tenant: str | None
    ) -> Slot | None:
        """A not-ready entry for ``key`` with a fresh slot, or None (the key is busy or the
        tier has no free slot now). Takes the lock."""
        with self._lock:
            if self._index.busy(key):
                return None
            slot = self._tier.allocate(key, nbytes)
            if slot is not None:
                self._index.reserve(key, slot, owner, deadline, tenant)
            return slot

    def live_reservation(self, key: ChunkKey, owner: str | None) -> Entry | None:
        """``owner``'s reservation of ``key`` while it may still be committed; one past its
        deadline is freed (its slot may have been rewritten) and None returned."""
        entry = self._index.entry(key)
        if entry is None or entry.ready or entry.deleted or entry.owner != owner:
            return None
        if entry.expired or entry.deadline <= time.monotonic():
            if entry.pins == 0:
                self.free(key)
            return None
        return entry

    def commit(self, key: ChunkKey, entry: Entry, *, pin: bool = False, touch: bool = True) -> None:
        """Publish a reservation (a store's or a promotion's): pinned first with ``pin``,
        made the most recently used with ``touch``."""
        if pin:
            self._index.pin(key)
        self._index.mark_ready(key, entry)
        if touch:
            self._index.touch(key)

    def renew(self, key: ChunkKey, owner: str, deadline: float) -> bool:
        """Extend ``owner``'s live reservation of ``key`` to ``deadline`` (never shorter);
        False once it expired or is gone."""
        entry = self._index.entry(key)
        if entry is None or entry.ready or entry.owner != owner or entry.expired:
            return False
        if entry.deadline <= time.monotonic():
            return False
        self._index.extend_deadline(key, deadline)
        return True

    def rekey(self, old: ChunkKey, new: ChunkKey) -> None:
        """A pooled reservation becomes ``new``'s."""
        self._index.rekey(old, new)
        self._tier.rename(old, new)

    def quarantine_expired(self, now: float) -> int:
        """Quarantine the unpinned reservations past their deadline; how many."""
        stale = [(k, e) for k, e in self._index.pending() if e.pins == 0 and e.deadline <= now]
        for key, entry in stale:
            self._index.quarantine(key, entry)
        return len(stale)

    def abort(self, keys: Sequence[ChunkKey]) -> int:
        """Free the unpinned reservations among ``keys``; how many. Takes the lock."""
        num = 0
        with self._lock:
            for key in keys:
                entry = self._index.entry(key)
                if entry is not None and not entry.ready and entry.pins == 0:
                    self.free(key)
                    num += 1
        return num

    # -- readable chunks -------------------------------------------------------------------

    def touch(self, key: ChunkKey) -> None:
        self._index.touch(key)

    def pin_prefix(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Pin (and touch) the leading readable chunks of ``keys``."""
        pinned: list[ChunkKey] = []
        for key in keys:
            if not self._index.readable(key):
                break
            self._index.pin(key)
            self._index.touch(key)
            pinned.append(key)
        return pinned

    def pin_readable(self, keys: Sequence[ChunkKey]) -> tuple[list[ChunkKey], list[Slot]]:
        """Pin the readable chunks among ``keys`` (for a copy outside the lock); their slots.
        Takes the lock."""
        with self._lock:
            pinned = [k for k in keys if self._index.readable(k)]
            for key in pinned:
                self._index.pin(key)
            return pinned, [self._index.slot_of(k) for k in pinned]

    def unpin(self, key: ChunkKey) -> None:
        """Drop one pin, freeing a chunk deleted while pinned."""
        if self._index.unpin(key):
            self.free(key)

    def unpin_all(self, keys: Sequence[ChunkKey]) -> None:
        """Drop one pin of each of ``keys``. Takes the lock."""
        with self._lock:
            for key in keys:
                self.unpin(key)

    def condemn(self, key: ChunkKey) -> None:
        """A pinned chunk is deleted (or found corrupted): freed when its last pin goes."""
        self._index.mark_deleted(key)

    def delete(self, key: ChunkKey) -> bool:
        """Delete a readable chunk (freed now, or when its last pin goes); False when there is
        none."""
        if not self._index.readable(key):
            return False
        entry = self._index.entry(key)
        if entry is not None and entry.pins:
            self._index.mark_deleted(key)
        else:
            self.free(key)
        return True

    def free(self, key: ChunkKey) -> None:
        """Drop a chunk's entry and its slot."""
        self._clear_sum(self._index.remove(key))
        self._tier.delete(key)

    # -- eviction --------------------------------------------------------------------------

    def take_for_demotion(self, nbytes: int) -> list[tuple[ChunkKey, Slot]]:
        """Remove the least recently used chunks at rest worth ``nbytes`` from the index; their
        keys stay busy, their slots allocated, until ``end_demotion``."""
        victims = self._index.least_recent_at_rest(nbytes)
        for key, _ in victims:
            self._index.remove_for_demotion(key)
        return victims

    def end_demotion(self, victims: Sequence[tuple[ChunkKey, Slot]]) -> None:
        """Free the slots of chunks taken by ``take_for_demotion``. Takes the lock."""
        with self._lock:
            for key, slot in victims:
                self._index.end_demotion(key)
                self._clear_sum(slot)
                self._tier.delete(key)

    # -- checksums -------------------------------------------------------------------------

    @property
    def checksums_on(self) -> bool:
        return self._sums is not None

    def stored_checksum(self, slot: Slot) -> int | None:
        """The slot's checksum, None when none was taken (or checksums are off)."""
        return None if self._sums is None else self._sums.stored(slot)

    def check(self, slot: Slot, data: Buffer) -> bool | None:
        """Whether ``data`` matches the slot's checksum (None: there is none to check)."""
        return None if self._sums is None else self._sums.check(slot, data)

    def record_checksum(self, slot: Slot, value: int) -> None:
        """Keep ``value`` as the slot's checksum unless one was taken meanwhile. Takes the
        lock."""
        if self._sums is None:
            return
        with self._lock:
            if self._sums.stored(slot) is None:
                self._sums.record(slot, value)

    def _clear_sum(self, slot: Slot) -> None:
        if self._sums is not None:
            self._sums.clear(slot)

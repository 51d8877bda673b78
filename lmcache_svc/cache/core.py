"""The parts of the tiered cache, built once and handed to each path of the protocol.

``CacheCore`` is a plain holder, not a base class: it creates the cache's one reentrant
lock (``lock``; the lock order is in the package docstring, ``cache/__init__.py``) and the
parts that share it: the first tier's slots and chunk index (``slots``, the index's only
owner), the moves among tiers (``moves``), the lower tiers (``lower``, with a lock of its
own), ``sessions``, the reservation budget, the namespaces, and the write-through and
checksum ``BackgroundQueue``s. The paths (``lookups``, ``stores``, ``placeholders``,
``loads``, ``maintenance``) each receive it explicitly; ``TieredCache`` is their facade.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from lmcache_svc.cache.background_queue import BackgroundQueue, Pace
from lmcache_svc.cache.first_tier_slots import FirstTierSlots
from lmcache_svc.cache.listener import ChunkListener
from lmcache_svc.cache.lower_tier_manager import LowerTierManager
from lmcache_svc.cache.moves import ChunkMoves
from lmcache_svc.cache.namespaces import Namespaces
from lmcache_svc.cache.quotas import ReservationBudget
from lmcache_svc.cache.sessions import Sessions
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.cache.values import TierPolicy
from lmcache_svc.keys import ChunkKey
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.index_publisher import IndexPublisher
from lmcache_svc.shm.arena import ARENA_TRANSPORT
from lmcache_svc.tiers.base import SlotTier, Tier


class CacheCore:
    def __init__(
        self,
        first: SlotTier,
        lower: Sequence[tuple[Tier, TierPolicy]],
        settings: CacheSettings,
        metrics: Metrics,
        lookup_index: IndexPublisher | None,
        listener: ChunkListener | None,
    ) -> None:
        if not isinstance(first, SlotTier):
            raise TypeError("the first tier must be a SlotTier (clients address it in place)")
        self.settings = settings
        self.metrics = metrics
        self.first = first
        self.listener = listener
        self.lookup_index = lookup_index
        self.lock = threading.RLock()
        """The cache's lock: created here and nowhere else."""
        self.lower = LowerTierManager(lower, metrics, listener)
        if lookup_index is not None:  # published chunks: see index_publisher.py
            lookup_index.set_lower_tiers(bool(lower))
        self.slots = FirstTierSlots(
            first,
            self.lock,
            _first_tier_hook(first, lookup_index, listener),
            checksums=settings.checksums,
        )
        self.moves = ChunkMoves(first, self.slots, self.lower, self.lock, metrics)
        self.namespaces = Namespaces(self.lock, settings, lookup_index, listener)
        self.reservations = ReservationBudget(
            self.slots,
            first.capacity_bytes,
            settings.max_reserved_fraction,
            settings.max_tenant_reserved_fraction,
        )
        self.sessions = Sessions(self.lock, self.slots, settings, metrics, abort=self.abort)
        self.stop = threading.Event()
        self.wake = threading.Event()
        """Set to run a maintenance step now (above the high watermark; closing)."""
        self.write_through = BackgroundQueue(
            self.moves.copy_through, enabled=self.lower.has_write_through
        )
        self.checksummer = BackgroundQueue(
            self.moves.record_checksums, enabled=settings.checksums, name="checksums",
            pace=Pace(settings.checksum_quiet_s, settings.checksum_max_delay_s),
            max_batch=8,  # paced between batches: a short one, so stores wait for little
        )  # fmt: skip

    @property
    def tiers(self) -> list[Tier]:
        return [self.first, *self.lower.tiers]

    def abort(self, keys: Sequence[ChunkKey]) -> int:
        """Free the unpinned reservations among ``keys`` (takes the lock); how many."""
        num = self.slots.abort(keys)
        self.update_pending()
        return num

    def wake_if_above_watermark(self) -> None:
        first = self.first
        if first.used_bytes > self.settings.high_watermark * first.capacity_bytes:
            self.wake.set()

    def update_pending(self) -> None:
        """Set the pending-store and quarantine gauges (takes the lock)."""
        with self.lock:
            num_pending, quarantined = self.slots.num_pending, self.slots.quarantined_bytes
        self.metrics.pending_stores.set(num_pending)
        self.metrics.quarantined_bytes.set(quarantined)

    def num_pending_stores(self) -> int:
        with self.lock:
            return self.slots.num_pending


def _first_tier_hook(
    first: SlotTier, lookup_index: IndexPublisher | None, listener: ChunkListener | None
) -> Callable[[ChunkKey, bool], None] | None:
    """What the first tier's index calls when a chunk becomes readable or stops being so.
    The lookup index gets a readable chunk's arena offset when the first tier is the shared
    arena sessions map (loads without a lease, ``shm.lookup_index``)."""
    if lookup_index is None:
        if listener is None:
            return None
        return lambda key, readable: listener.chunk_changed(first, key, readable)
    in_arena = first.segment().transport == ARENA_TRANSPORT

    def changed(key: ChunkKey, readable: bool) -> None:
        slot = first.slot_of(key) if readable and in_arena else None
        lookup_index.changed(key, readable, None if slot is None else slot.offset)
        if listener is not None:
            listener.chunk_changed(first, key, readable)

    return changed

"""The state every path of the tiered cache shares, and the helpers they all call.

``CacheCore`` builds the parts once: the first tier and its ``ChunkIndex``, the
``FirstTierManager`` and ``LowerTierManager``, ``Sessions``, the write-through and checksum
``BackgroundQueue``s, the lookup-index publisher's hooks, and the one reentrant lock they all
share. It also holds the registered namespaces, the sessions' entry points and the cache's
stats. The paths of the protocol are subclasses of it, one per module (``lookups``,
``stores``, ``placeholders``, ``loads``, ``maintenance``); ``TieredCache`` combines them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from lmcache_svc.cache.background_queue import BackgroundQueue, Pace
from lmcache_svc.cache.chunk_index import ChunkIndex
from lmcache_svc.cache.first_tier_manager import FirstTierManager
from lmcache_svc.cache.lower_tier_manager import LowerTierManager
from lmcache_svc.cache.sessions import Sessions
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.cache.values import CacheStats, TierPolicy
from lmcache_svc.errors import InvalidArgument, PayloadTooLarge, TooManyNamespaces, UnknownNamespace
from lmcache_svc.keys import ChunkKey, Namespace, NamespaceId, check_namespace_id, make_chunk_keys
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.index_publisher import IndexPublisher
from lmcache_svc.tiers.base import SegmentInfo, Slot, SlotTier, Tier


class CacheCore:
    def __init__(
        self,
        first: SlotTier,
        lower: Sequence[tuple[Tier, TierPolicy]] = (),
        *,
        settings: CacheSettings | None = None,
        metrics: Metrics | None = None,
        lookup_index: IndexPublisher | None = None,
    ) -> None:
        if not isinstance(first, SlotTier):
            raise TypeError("the first tier must be a SlotTier (clients address it in place)")
        self.settings = settings or CacheSettings()
        self.metrics = metrics or Metrics()
        self._first = first
        self._lower = LowerTierManager(lower, self.metrics)
        self._lock = threading.RLock()
        self._index = ChunkIndex(first.slot_of, self._lock)
        self.lookup_index = lookup_index
        if lookup_index is not None:  # published chunks: see index_publisher.py
            self._index.on_change = lookup_index.changed
            lookup_index.set_lower_tiers(bool(lower))
        self._first_tier = FirstTierManager(
            first,
            self._index,
            self._lower,
            self._lock,
            self.metrics,
            checksums=self.settings.checksums,
        )
        self._namespaces: dict[NamespaceId, Namespace] = {}
        self._sessions = Sessions(
            self._lock,
            self._index,
            self.settings,
            self.metrics,
            unpin=self._first_tier.unpin,
            abort=self._abort_keys,
        )
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._maintenance: threading.Thread | None = None
        self._write_through = BackgroundQueue(
            self._first_tier.copy_through, enabled=self._lower.has_write_through
        )
        self._checksummer = BackgroundQueue(
            self._first_tier.record_checksums, enabled=self.settings.checksums, name="checksums",
            pace=Pace(self.settings.checksum_quiet_s, self.settings.checksum_max_delay_s),
            max_batch=8,  # paced between batches: a short one, so stores wait for little
        )  # fmt: skip
        self._media = {t.name: t.medium for t in self.tiers}
        self.metrics.watch_tiers(lambda: [t.stats() for t in self.tiers])

    @property
    def tiers(self) -> list[Tier]:
        return [self._first, *self._lower.tiers]

    def segment(self) -> SegmentInfo:
        return self._first.segment()

    def view(self, slot: Slot) -> memoryview:
        return self._first.view(slot)

    # -- namespaces and sessions ---------------------------------------------------------

    def register_namespace(self, namespace: Namespace) -> Namespace:
        """Register (or find again) a namespace; ``TooManyNamespaces`` past the limit."""
        limit = self.settings.max_chunk_bytes
        if namespace.chunk_bytes > limit:
            raise InvalidArgument(
                f"namespace chunk_bytes is {namespace.chunk_bytes}, over this server's "
                f"max_body_bytes ({limit}): use a smaller chunk_size"
            )
        with self._lock:
            known = self._namespaces.get(namespace.namespace_id)
            if known is not None:
                return known
            if len(self._namespaces) >= self.settings.max_namespaces:
                raise TooManyNamespaces(
                    f"this server holds {len(self._namespaces)} namespaces, its limit "
                    "(cache.max_namespaces); registered ones keep working"
                )
            self._namespaces[namespace.namespace_id] = namespace
            if self.lookup_index is not None:
                self.lookup_index.add_namespace(namespace)
            return namespace

    def namespace(self, namespace_id: bytes) -> Namespace:
        ns_id = check_namespace_id(namespace_id)
        try:
            return self._namespaces[ns_id]
        except KeyError:
            raise UnknownNamespace(
                f"namespace {ns_id.hex()} is not registered; register it first"
            ) from None

    def open_session(self) -> str:
        return self._sessions.open_session()

    def has_session(self, session_id: str) -> bool:
        return self._sessions.has_session(session_id)

    def close_session(self, session_id: str) -> None:
        """The client is gone: give back its reservations and leases now."""
        self._sessions.close_session(session_id)

    def check_batch(self, namespace_id: bytes, num_chunks: int) -> Namespace:
        """The registered namespace of a request for ``num_chunks`` chunks, once that count
        is within ``max_chunks_per_request`` (``PayloadTooLarge`` otherwise)."""
        if num_chunks > self.settings.max_chunks_per_request:
            raise PayloadTooLarge(
                f"{num_chunks} chunks in one request; the limit is "
                f"{self.settings.max_chunks_per_request}"
            )
        return self.namespace(namespace_id)

    def _keys(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> list[ChunkKey]:
        ns = self.check_batch(namespace_id, len(chunk_hashes))
        return make_chunk_keys(ns.namespace_id, chunk_hashes)

    # -- helpers ---------------------------------------------------------------------------

    def _abort_keys(self, keys: Sequence[ChunkKey]) -> int:
        num = 0
        with self._lock:
            for key in keys:
                entry = self._index.entry(key)
                if entry is not None and not entry.ready and entry.pins == 0:
                    self._first_tier.free(key)
                    num += 1
        self._update_pending()
        return num

    def _wake_if_above_watermark(self) -> None:
        if self._first.used_bytes > self.settings.high_watermark * self._first.capacity_bytes:
            self._wake.set()

    def _update_pending(self) -> None:
        with self._lock:
            num_pending, quarantined = self._index.num_pending, self._index.quarantined_bytes
        self.metrics.pending_stores.set(num_pending)
        self.metrics.quarantined_bytes.set(quarantined)

    def num_pending_stores(self) -> int:
        with self._lock:
            return self._index.num_pending

    def stats(self) -> CacheStats:
        with self._lock:
            num_leases, num_ns = self._sessions.num_leases, len(self._namespaces)
        return CacheStats(
            tiers=[t.stats() for t in self.tiers],
            active_leases=num_leases,
            pending_stores=self.num_pending_stores(),
            num_namespaces=num_ns,
        )

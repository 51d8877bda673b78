"""The tiered cache: an ordered list of tiers and the policy that moves chunks between them.

The first tier is a ``SlotTier`` (the shared-memory arena): clients write and read it in
place. Lower tiers (SSD, Redis) receive evicted chunks (demotion) or every committed chunk
(write-through), and a chunk found only in a lower tier is copied up into the first tier
when it is loaded (promotion). The cache never asks which tier is which: behaviour comes
from each tier's ``TierPolicy`` and from whether the tier is ``shared``.

Ownership is two-phase and explicit:

- store: ``prepare_store`` reserves slots (owned by a session, with a deadline; one owner
  holds at most ``max_reserved_fraction`` of the first tier), ``commit_store`` publishes
  them, ``abort_store``/session end gives them back. A reservation past its deadline is
  quarantined, never reused while its writer may still write: a late commit publishes
  nothing (it answers 0 and frees the slot), as does a late abort or the session's end;
- load: ``prepare_load`` pins the longest available prefix under a lease, ``release_load``
  (or expiry, or session end) unpins. A pinned chunk is never evicted, demoted or freed.

One lock guards the indices; bulk copies to and from lower tiers happen outside it, on
entries that are pinned, or removed from the index for demotion, for the duration.
``TieredCache`` is a facade: it builds the parts (``core.CacheCore``) and one object per path
of the protocol, each given the parts explicitly: ``lookups``, ``stores`` (store, commit,
abort, delete), ``placeholders`` (the store pool's ``bind_store``), ``loads`` and
``maintenance`` (the background thread, eviction to the watermark, expiry, flush, close).
Which part owns which state, and the lock order: the package docstring (``__init__.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmcache_svc.cache.core import CacheCore
from lmcache_svc.cache.listener import ChunkListener
from lmcache_svc.cache.loads import LoadPath
from lmcache_svc.cache.lookups import LookupPath
from lmcache_svc.cache.maintenance import Maintenance
from lmcache_svc.cache.placeholders import PlaceholderBinding
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.cache.stores import StorePath
from lmcache_svc.cache.values import (
    CacheStats,
    LeasedSlots,
    LookupResult,
    PreparedStore,
    TierPolicy,
)
from lmcache_svc.keys import Namespace
from lmcache_svc.metrics import Metrics
from lmcache_svc.tiers.base import Buffer, SegmentInfo, Slot, SlotTier, Tier

if TYPE_CHECKING:
    from lmcache_svc.server.index_publisher import IndexPublisher


class TieredCache:
    """The tiered cache over a first tier (a ``SlotTier``) and lower tiers with their
    policies; ``start`` its background work, ``close`` it when done."""

    def __init__(
        self,
        first: SlotTier,
        lower: Sequence[tuple[Tier, TierPolicy]] = (),
        *,
        settings: CacheSettings | None = None,
        metrics: Metrics | None = None,
        lookup_index: IndexPublisher | None = None,
        listener: ChunkListener | None = None,
    ) -> None:
        core = CacheCore(
            first, lower, settings or CacheSettings(), metrics or Metrics(), lookup_index, listener
        )
        self._core = core
        self.settings = core.settings
        self.metrics = core.metrics
        self.listener = listener
        self.lookup_index = lookup_index
        self._lookups = LookupPath(core)
        self._stores = StorePath(core)
        self._placeholders = PlaceholderBinding(core, self._stores)
        self._loads = LoadPath(core)
        self._maintenance = Maintenance(core)
        self.metrics.watch_tiers(lambda: [t.stats() for t in self.tiers])

    # -- tiers, namespaces, sessions -------------------------------------------------------

    @property
    def tiers(self) -> list[Tier]:
        return self._core.tiers

    def segment(self) -> SegmentInfo:
        return self._core.first.segment()

    def view(self, slot: Slot) -> memoryview:
        return self._core.first.view(slot)

    def register_namespace(self, namespace: Namespace) -> Namespace:
        """Register (or find again) a namespace; ``TooManyNamespaces`` past the limit."""
        return self._core.namespaces.register(namespace)

    def namespace(self, namespace_id: bytes) -> Namespace:
        return self._core.namespaces.get(namespace_id)

    def check_batch(self, namespace_id: bytes, num_chunks: int) -> Namespace:
        """The registered namespace of a request for ``num_chunks`` chunks, once that count
        is within ``max_chunks_per_request`` (``PayloadTooLarge`` otherwise)."""
        return self._core.namespaces.check_batch(namespace_id, num_chunks)

    def open_session(self) -> str:
        return self._core.sessions.open_session()

    def has_session(self, session_id: str) -> bool:
        return self._core.sessions.has_session(session_id)

    def close_session(self, session_id: str) -> None:
        """The client is gone: give back its reservations and leases now."""
        self._core.sessions.close_session(session_id)

    # -- lookups ---------------------------------------------------------------------------

    def lookup(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> LookupResult:
        """Longest contiguous prefix of the chunks present in any tier, and where each is."""
        return self._lookups.lookup(namespace_id, chunk_hashes)

    def lookup_local(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes]
    ) -> LookupResult | None:
        """``lookup``'s answer when the in-memory indices give all of it, else None."""
        return self._lookups.lookup_local(namespace_id, chunk_hashes)

    def first_tier_holds(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> bool:
        """Whether every chunk is readable in the first tier now (a load needs no lower tier)."""
        return self._lookups.first_tier_holds(namespace_id, chunk_hashes)

    def contains(self, namespace_id: bytes, chunk_hash: bytes) -> str | None:
        """Name of the tier holding the chunk, or None."""
        return self._lookups.contains(namespace_id, chunk_hash)

    # -- stores ----------------------------------------------------------------------------

    def prepare_store(
        self,
        namespace_id: bytes,
        chunk_hashes: Sequence[bytes],
        *,
        session_id: str | None = None,
        ttl_s: float | None = None,
    ) -> list[PreparedStore]:
        return self._stores.prepare_store(
            namespace_id, chunk_hashes, session_id=session_id, ttl_s=ttl_s
        )

    def commit_store(
        self,
        namespace_id: bytes,
        chunk_hashes: Sequence[bytes],
        *,
        session_id: str | None = None,
        token_ids: bytes = b"",
        parent_hashes: Sequence[bytes] = (),
    ) -> int:
        """Publish reserved chunks (``stores.StorePath.commit_store``)."""
        return self._stores.commit_store(
            namespace_id, chunk_hashes, session_id=session_id, token_ids=token_ids,
            parent_hashes=parent_hashes,
        )  # fmt: skip

    def bind_store(
        self,
        namespace_id: bytes,
        chunk_hashes: Sequence[bytes],
        reserved_as: Sequence[bytes],
        *,
        session_id: str | None = None,
        token_ids: bytes = b"",
        parent_hashes: Sequence[bytes] = (),
    ) -> tuple[int, list[bytes]]:
        """Commit pooled reservations under the chunks written into them
        (``placeholders.PlaceholderBinding.bind_store``)."""
        return self._placeholders.bind_store(
            namespace_id, chunk_hashes, reserved_as, session_id=session_id,
            token_ids=token_ids, parent_hashes=parent_hashes,
        )  # fmt: skip

    def abort_store(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], *, session_id: str | None = None
    ) -> int:
        return self._stores.abort_store(namespace_id, chunk_hashes, session_id=session_id)

    def put(
        self,
        namespace_id: bytes,
        chunk_hash: bytes,
        data: Buffer,
        *,
        token_ids: bytes = b"",
        parent_hash: bytes = b"",
    ) -> str:
        """Store one chunk given inline; returns the prepare status ('reserved' = stored)."""
        return self._stores.put(
            namespace_id, chunk_hash, data, token_ids=token_ids, parent_hash=parent_hash
        )

    def renew_store(
        self, namespace_id: bytes, chunk_hash: bytes, owner: str, deadline: float
    ) -> bool:
        """True while ``owner`` still holds the chunk's reservation, then extended to
        ``deadline``; False once it expired or is gone."""
        return self._stores.renew_store(namespace_id, chunk_hash, owner, deadline)

    def delete(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> int:
        """Remove the chunks from every tier; returns how many were present anywhere."""
        return self._stores.delete(namespace_id, chunk_hashes)

    def num_pending_stores(self) -> int:
        return self._core.num_pending_stores()

    # -- loads -----------------------------------------------------------------------------

    def prepare_load(
        self,
        namespace_id: bytes,
        chunk_hashes: Sequence[bytes],
        *,
        session_id: str | None = None,
        ttl_s: float | None = None,
        verify: bool = False,
    ) -> LeasedSlots:
        """Pin the longest available prefix in the first tier, promoting from lower tiers;
        with ``verify``, only the leading chunks whose bytes match their checksums."""
        return self._loads.prepare_load(
            namespace_id, chunk_hashes, session_id=session_id, ttl_s=ttl_s, verify=verify
        )

    def release_load(self, lease_id: str) -> bool:
        return self._loads.release_load(lease_id)

    def touch(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> int:
        """Chunks read in place without a lease: touched and counted as read; how many."""
        return self._loads.touch(namespace_id, chunk_hashes)

    def get(
        self, namespace_id: bytes, chunk_hash: bytes, *, verify: bool = False
    ) -> tuple[bytes, str] | None:
        """One chunk's bytes and the tier it was found in, or None."""
        return self._loads.get(namespace_id, chunk_hash, verify=verify)

    # -- lifecycle and maintenance ---------------------------------------------------------

    def start(self) -> None:
        """Start background maintenance (expiry, watermark eviction) and write-through."""
        self._maintenance.start()

    def close(self) -> None:
        """Stop background work, finish queued write-throughs, close every tier."""
        self._maintenance.close()

    def evict_to_watermark(self) -> int:
        """Evict from the first tier until it is under the low watermark; returns chunks."""
        return self._maintenance.evict_to_watermark()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write-through copy and checksum is done; False on timeout."""
        return self._maintenance.flush(timeout_s)

    def reap_expired(self, now: float | None = None) -> int:
        """Release leases past their deadline and quarantine such reservations; how many."""
        return self._maintenance.reap_expired(now)

    def stats(self) -> CacheStats:
        core = self._core
        with core.lock:
            num_leases, num_ns = core.sessions.num_leases, len(core.namespaces)
        return CacheStats(
            tiers=[t.stats() for t in self.tiers],
            active_leases=num_leases,
            pending_stores=self.num_pending_stores(),
            num_namespaces=num_ns,
        )

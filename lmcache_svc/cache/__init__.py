"""The tiered cache: ``TieredCache`` and the parts it is made of (docs/architecture.md,
"The cache package").

``TieredCache`` (``tiered_cache.py``) is a facade: it builds a ``CacheCore`` (``core.py``,
a plain holder of the parts) and one object per path of the protocol, each handed the core
explicitly: ``LookupPath``, ``StorePath``, ``PlaceholderBinding`` (over ``StorePath``),
``LoadPath`` and ``Maintenance``. No part subclasses another.

Who owns what (each part changes only its own state; the others call its methods):

- ``CacheCore``: the cache's one lock (``CacheCore.lock``, a reentrant lock created there
  and nowhere else) and the maintenance wake-up/stop events;
- ``FirstTierSlots``: the chunk index (``ChunkIndex``: entries, LRU order, pins,
  reservations, quarantine, keys being demoted) and the arena's checksums. It is the only
  code that changes the index (``tests/cache/test_structure.py``); the index itself checks,
  with ``LMCACHE_CHECK_LOCKS=1`` (the test suite), that each change holds the cache lock;
- ``ChunkMoves``: nothing of its own: it decides what moves (eviction and demotion,
  promotion, write-through copies, checksum checks) and asks ``FirstTierSlots`` and
  ``LowerTierManager`` to do it;
- ``LowerTierManager``: the lower tiers' indices, breakers, probes and resyncs;
- ``Sessions``: sessions and load leases (and the tenants' lease quota);
- ``ReservationBudget``: the reservation charges of requests in progress;
- ``Namespaces``: the registered namespaces;
- ``Maintenance``: the maintenance thread; ``BackgroundQueue`` (two, in the core): the
  write-through and checksum queues and their threads.

Lock order (a lock is only ever taken while holding those before it, never the reverse):

1. the cache lock (``CacheCore.lock``). Reentrant, and re-entered on purpose:
   ``PlaceholderBinding.bind_store`` commits (``StorePath.commit_keys``) under the hold it
   rekeyed under; ``Sessions.release`` unpins (``FirstTierSlots.unpin``, which may free)
   under its own hold; ``ChunkMoves.allocate`` reserves (``FirstTierSlots.reserve``) under it.
2. under it, briefly, each of: the lower-tier manager's lock (``local_tier``,
   ``delete_count``; then a breaker's lock under that); the first tier's allocator lock
   (``allocate``, ``delete``, ``rename``); the lookup-index publisher's lock
   (the index's ``on_change``, ``add_namespace``, ``close``); a ``BackgroundQueue``'s
   condition (``submit`` from ``bind_store``). None of them calls back into the cache while
   held.
3. listener callbacks (``ChunkListener``) last: ``chunk_changed`` for the first tier and
   ``chunk_described`` and ``namespace_registered`` run under the cache lock, the lower
   tiers' ``chunk_changed`` and ``tier_contents`` under the lower-tier manager's lock or
   none. A listener must be quick and never call into the cache.

Calls made without any cache lock: bulk copies (on pinned chunks, or on chunks removed
from the index for demotion), every call to a lower tier, and ``Sessions``' ``abort``
callback (``CacheCore.abort``, taken after ``close_session`` let go of the lock; it takes
the lock again). The background queues' threads call ``ChunkMoves.copy_through`` and
``record_checksums`` without the queue's condition held; those take the cache lock
briefly themselves.
"""

from __future__ import annotations

from lmcache_svc.cache.tiered_cache import TieredCache

__all__ = ["TieredCache"]

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
entries that are pinned, or removed from the index for demotion, for the duration. The
cache is the protocol, one path per module over a shared core (``core``: the parts, the lock, the
namespaces): ``lookups``, ``stores`` (store, commit, abort, delete), ``placeholders`` (the
store pool's ``bind_store``), ``loads`` and ``maintenance`` (the background thread,
eviction to the watermark, expiry, flush, close). The parts live beside them in this package
and share the lock: ``chunk_index`` (the first tier's index), ``first_tier_manager`` (slots,
eviction, promotion, write-through copies), ``lower_tier_manager`` (the lower tiers' indices
and moves among them), ``sessions`` (sessions, leases, deadlines), ``background_queue`` (the
write-through and checksum threads) and ``values`` (settings and result types).
"""

from __future__ import annotations

from lmcache_svc.cache.loads import LoadPath
from lmcache_svc.cache.lookups import LookupPath
from lmcache_svc.cache.maintenance import Maintenance
from lmcache_svc.cache.placeholders import PlaceholderBinding


class TieredCache(LookupPath, PlaceholderBinding, LoadPath, Maintenance):
    """The tiered cache: built by ``CacheCore.__init__`` (first tier, lower tiers with their
    policies, settings, metrics, optional lookup-index publisher); ``start`` its background
    work, ``close`` it when done."""

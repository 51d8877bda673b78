"""Sessions and what they hold: load leases, store reservations, and their deadlines.

A session is a client's stream; when it ends, everything it holds is given back at once.
A lease pins a run of chunks for a reader until it is released, its deadline passes or its
session ends; each tenant's leases are bounded (``quotas.LeaseQuota``). A reservation (a
not-ready entry in the chunk index, owned by a session) that
passes its deadline is quarantined (``FirstTierSlots.quarantine_expired``: its writer may
still be writing into the slot, so the slot is not reused) until its owner commits or aborts
it or its session ends. Pins and reservations are the first tier's (``FirstTierSlots``, the
chunk index's owner): a released lease unpins there; aborting a session's reservations is
passed in as ``abort`` (it also updates the cache's pending-store gauges).

Locking: every method takes the cache's lock (shared, reentrant); ``FirstTierSlots.unpin``
is called with it held, ``abort`` without (it takes the lock itself).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lmcache_svc.cache.first_tier_slots import FirstTierSlots
from lmcache_svc.cache.quotas import LeaseQuota
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.errors import InvalidArgument
from lmcache_svc.keys import ChunkKey
from lmcache_svc.metrics import Metrics


@dataclass(slots=True)
class Lease:
    keys: list[ChunkKey]
    session_id: str | None
    deadline: float
    tenant: str


class Sessions:
    def __init__(
        self,
        lock: threading.RLock,
        slots: FirstTierSlots,
        settings: CacheSettings,
        metrics: Metrics,
        *,
        abort: Callable[[Sequence[ChunkKey]], int],
    ) -> None:
        self._lock = lock
        self._slots = slots
        self._settings = settings
        self._metrics = metrics
        self._abort = abort
        self._leases: dict[str, Lease] = {}
        self._sessions: set[str] = set()
        self._quota = LeaseQuota(settings.max_tenant_leases, settings.max_tenant_leased_chunks)

    # -- sessions --------------------------------------------------------------------------

    def open_session(self) -> str:
        session_id = secrets.token_hex(8)
        with self._lock:
            self._sessions.add(session_id)
        return session_id

    def has_session(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions

    def close_session(self, session_id: str) -> None:
        """The client is gone: give back its reservations and leases now."""
        with self._lock:
            self._sessions.discard(session_id)
            lease_ids = [i for i, lease in self._leases.items() if lease.session_id == session_id]
            owned = [k for k, e in self._slots.pending() if e.owner == session_id]
            quarantined = self._slots.quarantined_of(session_id)  # counted when they expired
        for lease_id in lease_ids:
            if self.release(lease_id):
                self._metrics.expired.labels(what="lease").inc()
        self._metrics.expired.labels(what="reservation").inc(self._abort(owned))
        self._abort(quarantined)

    # -- leases ----------------------------------------------------------------------------

    def charge_lease(self, tenant: str, session_id: str | None, num_chunks: int) -> None:
        """Charge a load about to pin up to ``num_chunks`` chunks to its tenant's lease quota
        (``quotas.LeaseQuota``: ``LeaseLimit`` over it); ``grant`` or ``uncharge_lease``
        gives the charge back."""
        with self._lock:
            self._quota.take(tenant, session_id is None, num_chunks)

    def uncharge_lease(self, tenant: str, session_id: str | None, num_chunks: int) -> None:
        """The load charged ``num_chunks`` pinned nothing: no lease."""
        with self._lock:
            self._quota.give(tenant, session_id is None, 1, num_chunks)

    def grant(
        self,
        keys: list[ChunkKey],
        session_id: str | None,
        deadline: float,
        tenant: str,
        charged: int,
    ) -> str:
        """A new lease on ``keys`` (already pinned), for a load charged ``charged`` chunks of
        ``tenant``'s quota (what it did not pin is given back); returns its id."""
        lease_id = secrets.token_hex(12)
        with self._lock:
            self._quota.give(tenant, session_id is None, 0, charged - len(keys))
            self._leases[lease_id] = Lease(keys, session_id, deadline, tenant)
            self._metrics.active_leases.set(len(self._leases))
        return lease_id

    def release(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            for key in lease.keys:
                self._slots.unpin(key)
            self._quota.give(lease.tenant, lease.session_id is None, 1, len(lease.keys))
            self._metrics.active_leases.set(len(self._leases))
        return True

    @property
    def num_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    # -- deadlines -------------------------------------------------------------------------

    def deadline(self, ttl_s: float | None, default: float, limit: float) -> float:
        """Monotonic deadline for a lease or reservation (``ttl_s`` None or 0: ``default``;
        over ``limit`` seconds: an error)."""
        return time.monotonic() + self._ttl(ttl_s, default, limit)

    @staticmethod
    def _ttl(ttl_s: float | None, default: float, limit: float) -> float:
        if ttl_s is None or ttl_s == 0:
            return default
        if not 0 < ttl_s <= limit:
            raise InvalidArgument(f"ttl must be in (0, {limit}] seconds, got {ttl_s}")
        return ttl_s

    def reap_expired(self, now: float | None = None) -> int:
        """Release leases past their deadline and quarantine such reservations; returns how
        many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            lease_ids = [i for i, lease in self._leases.items() if lease.deadline <= now]
            num_stale = self._slots.quarantine_expired(now)
        for lease_id in lease_ids:
            self.release(lease_id)
        self._metrics.expired.labels(what="lease").inc(len(lease_ids))
        self._metrics.expired.labels(what="reservation").inc(num_stale)
        return len(lease_ids) + num_stale

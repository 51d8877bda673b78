"""What one session and one tenant may hold of the first tier: reservations and load leases.

**Reservations** (``ReservationBudget``). An owner (a session, or one inline upload) holds at
most ``max_reserved_fraction`` of the first tier reserved, and a tenant, all its owners
together, at most ``max_tenant_reserved_fraction``; an owner or tenant holding nothing may
always reserve one chunk. What is held is what the chunk index counts (``owned_bytes``,
``tenant_bytes``, read through ``FirstTierSlots``: quarantined reservations included) plus
what requests in progress are about to reserve: a request charges its bytes before it
reserves and gives the charge back when it is done, so concurrent requests never exceed a
share together.

A quarantined reservation (expired while its writer may still write into its slot) counts
against its owner and tenant until it can be reclaimed, and no sooner: when its owner
commits it (which publishes nothing) or aborts it, or when its session ends. Before that a
client holding a writable view of the slot could still write into it, so handing the slot
to another chunk would let a late write corrupt that chunk. The shares bound what one
misbehaving client (or tenant) keeps out of circulation meanwhile.

**Load leases** (``LeaseQuota``). A tenant holds at most ``max_tenant_leases`` leases pinning
``max_tenant_leased_chunks`` chunks in all (a chunk in two leases counted twice: the
bookkeeping is per lease), and its session-less leases, which no session end gives back,
at most half of each, so session-less or read-only callers cannot take what the tenant's
engines need. A load is charged the chunks it asks for before it pins anything, then only
those it pinned.

Locking: every method is called with the cache's lock held.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from lmcache_svc.cache.first_tier_slots import FirstTierSlots
from lmcache_svc.errors import LeaseLimit, ReservationLimit

K = TypeVar("K")


class ReservationBudget:
    def __init__(
        self,
        slots: FirstTierSlots,
        capacity_bytes: int,
        owner_fraction: float,
        tenant_fraction: float,
    ) -> None:
        self._slots = slots
        self._owner_limit = int(owner_fraction * capacity_bytes)
        # 1: no share of its own (a tenant can never hold more than the whole tier)
        self._tenant_limit = None if tenant_fraction >= 1 else int(tenant_fraction * capacity_bytes)
        self._owner_charges: dict[str | None, int] = {}
        self._tenant_charges: dict[str, int] = {}

    def charge(self, owner: str | None, tenant: str, nbytes: int, chunk_bytes: int) -> None:
        """Charge a request about to reserve ``nbytes``; ``ReservationLimit`` over a share."""
        owner_held = self._slots.owned_bytes(owner) + self._owner_charges.get(owner, 0)
        tenant_held = self._slots.tenant_bytes(tenant) + self._tenant_charges.get(tenant, 0)
        if owner_held + nbytes > max(self._owner_limit, chunk_bytes):
            who = f"session {owner!r}" if owner else "session-less callers"
            raise ReservationLimit(
                f"{who} would hold {owner_held + nbytes} bytes reserved (expired "
                f"reservations not yet committed or aborted included); the limit is "
                f"{self._owner_limit} bytes (cache.max_reserved_fraction of the first "
                "tier): commit or abort first"
            )
        limit = self._tenant_limit
        if limit is not None and tenant_held + nbytes > max(limit, chunk_bytes):
            raise ReservationLimit(
                f"tenant {tenant!r} would hold {tenant_held + nbytes} bytes reserved over all "
                f"its sessions (expired reservations not yet committed or aborted "
                f"included); the limit is {limit} bytes "
                "(cache.max_tenant_reserved_fraction of the first tier)"
            )
        _add(self._owner_charges, owner, nbytes)
        _add(self._tenant_charges, tenant, nbytes)

    def uncharge(self, owner: str | None, tenant: str, nbytes: int) -> None:
        """The request is done: its reservations are counted by the index now."""
        _add(self._owner_charges, owner, -nbytes)
        _add(self._tenant_charges, tenant, -nbytes)


@dataclass(slots=True)
class _Held:
    leases: int = 0
    chunks: int = 0


class LeaseQuota:
    def __init__(self, max_leases: int, max_chunks: int) -> None:
        self._max_leases = max_leases
        self._max_chunks = max_chunks
        self._all: dict[str, _Held] = {}
        self._sessionless: dict[str, _Held] = {}

    def take(self, tenant: str, sessionless: bool, num_chunks: int) -> None:
        """One lease of ``num_chunks`` chunks for ``tenant``; ``LeaseLimit`` over a share."""
        held = self._all.get(tenant) or _Held()
        self._check(tenant, "", held, num_chunks, self._max_leases, self._max_chunks)
        if sessionless:
            mine = self._sessionless.get(tenant) or _Held()
            self._check(tenant, "session-less ", mine, num_chunks,
                        self._max_leases // 2, self._max_chunks // 2)  # fmt: skip
            _grow(self._sessionless, tenant, 1, num_chunks)
        _grow(self._all, tenant, 1, num_chunks)

    def give(self, tenant: str, sessionless: bool, num_leases: int, num_chunks: int) -> None:
        """Give back ``num_leases`` leases (0: a lease that shrank) of ``num_chunks``."""
        _grow(self._all, tenant, -num_leases, -num_chunks)
        if sessionless:
            _grow(self._sessionless, tenant, -num_leases, -num_chunks)

    @staticmethod
    def _check(
        tenant: str, kind: str, held: _Held, num_chunks: int, max_leases: int, max_chunks: int
    ) -> None:
        if held.leases + 1 > max_leases:
            raise LeaseLimit(
                f"tenant {tenant!r} holds {held.leases} {kind}load leases, its limit "
                f"({max_leases}: cache.max_tenant_leases"
                f"{', half of it for session-less leases' if kind else ''}); release some"
            )
        if held.chunks + num_chunks > max_chunks:
            raise LeaseLimit(
                f"tenant {tenant!r}'s {kind}load leases would pin {held.chunks + num_chunks} "
                f"chunks, over its limit ({max_chunks}: cache.max_tenant_leased_chunks"
                f"{', half of it for session-less leases' if kind else ''}); release some"
            )


def _add(charges: dict[K, int], name: K, nbytes: int) -> None:
    total = charges.get(name, 0) + nbytes
    if total:
        charges[name] = total
    else:
        charges.pop(name, None)


def _grow(held: dict[str, _Held], tenant: str, leases: int, chunks: int) -> None:
    entry = held.setdefault(tenant, _Held())
    entry.leases += leases
    entry.chunks += chunks
    if entry.leases == 0 and entry.chunks == 0:
        del held[tenant]

"""Quotas per tenant: reservations (quarantined ones included) and load leases.

One session holds at most ``max_reserved_fraction`` of the arena reserved, and one tenant,
however many sessions it opens, at most ``max_tenant_reserved_fraction``; a tenant holds at
most ``max_tenant_leases`` leases pinning ``max_tenant_leased_chunks`` chunks, and its
session-less leases (which no session end gives back) at most half of each."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator

import pytest

from lmcache_svc.cache import TieredCache
from lmcache_svc.errors import LeaseLimit, ReservationLimit
from lmcache_svc.keys import Namespace
from tests.caches import CacheFactory
from tests.helpers import make_namespace

ACME = make_namespace(model="m", chunk_size=256, tenant="acme")
ACME2 = make_namespace(model="m2", chunk_size=256, tenant="acme")
GLOBEX = make_namespace(model="m", chunk_size=256, tenant="globex")
CHUNK = ACME.chunk_bytes
FOREVER = float("inf")


def hashes(name: str, num: int) -> list[bytes]:
    return [hashlib.sha256(f"{name}/{i}".encode()).digest() for i in range(num)]


@pytest.fixture
def make_cache() -> Iterator[CacheFactory]:
    with CacheFactory(CHUNK, [ACME, ACME2, GLOBEX]) as factory:
        yield factory


def reserve(cache: TieredCache, ns: Namespace, session: str, name: str, num: int) -> int:
    prepared = cache.prepare_store(ns.namespace_id, hashes(name, num), session_id=session)
    return sum(p.status == "reserved" for p in prepared)


def test_many_sessions_of_one_tenant_hold_at_most_its_share(make_cache: CacheFactory) -> None:
    cache = make_cache(20, max_reserved_fraction=0.5, max_tenant_reserved_fraction=0.5)
    sessions = [cache.open_session() for _ in range(3)]
    assert reserve(cache, ACME, sessions[0], "a", 6) == 6  # 6 of 20 chunks
    assert reserve(cache, ACME2, sessions[1], "b", 4) == 4  # 10: the tenant's share
    with pytest.raises(ReservationLimit, match="tenant 'acme'.*max_tenant_reserved_fraction"):
        reserve(cache, ACME, sessions[2], "c", 1)
    assert reserve(cache, GLOBEX, cache.open_session(), "g", 10) == 10  # another tenant's room


def test_a_thousand_one_chunk_sessions_do_not_take_the_arena(make_cache: CacheFactory) -> None:
    cache = make_cache(16, max_tenant_reserved_fraction=0.25)
    held = 0
    for i in range(1000):
        try:
            held += reserve(cache, ACME, cache.open_session(), f"s{i}", 1)
        except ReservationLimit:
            pass
    assert held == 4  # a quarter of 16 chunks
    assert reserve(cache, GLOBEX, cache.open_session(), "g", 4) == 4


def test_quarantined_reservations_count_against_the_tenant_until_reclaimed(
    make_cache: CacheFactory,
) -> None:
    cache = make_cache(8, max_reserved_fraction=0.5, max_tenant_reserved_fraction=0.5)
    a, b = cache.open_session(), cache.open_session()
    cache.prepare_store(ACME.namespace_id, hashes("a", 2), session_id=a, ttl_s=1)
    cache.prepare_store(ACME.namespace_id, hashes("b", 2), session_id=b, ttl_s=1)
    assert cache.reap_expired(now=FOREVER) == 4  # all four quarantined
    with pytest.raises(ReservationLimit, match="tenant 'acme'"):
        reserve(cache, ACME, cache.open_session(), "c", 1)
    cache.abort_store(ACME.namespace_id, hashes("a", 2), session_id=a)  # a lets go
    cache.close_session(b)  # b is gone
    assert reserve(cache, ACME, cache.open_session(), "c", 4) == 4


def test_a_tenant_holding_nothing_may_always_reserve_one_chunk(make_cache: CacheFactory) -> None:
    cache = make_cache(4, max_tenant_reserved_fraction=0.01)
    assert reserve(cache, ACME, cache.open_session(), "a", 1) == 1
    with pytest.raises(ReservationLimit):
        reserve(cache, ACME, cache.open_session(), "b", 1)


def test_concurrent_sessions_never_exceed_the_tenants_share(make_cache: CacheFactory) -> None:
    cache = make_cache(64, max_tenant_reserved_fraction=0.25)
    got: list[int] = []
    barrier = threading.Barrier(8)

    def one(i: int) -> None:
        session = cache.open_session()
        barrier.wait()
        try:
            got.append(reserve(cache, ACME, session, f"t{i}", 4))
        except ReservationLimit:
            got.append(0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(got) == 16  # exactly a quarter of 64, never more


def stored(cache: TieredCache, ns: Namespace, name: str, num: int) -> list[bytes]:
    session = cache.open_session()
    hs = hashes(name, num)
    cache.prepare_store(ns.namespace_id, hs, session_id=session)
    assert cache.commit_store(ns.namespace_id, hs, session_id=session) == num
    return hs


def test_session_less_leases_are_capped_per_tenant(make_cache: CacheFactory) -> None:
    cache = make_cache(64, max_tenant_leases=8, max_tenant_leased_chunks=1000)
    hs = stored(cache, ACME, "x", 4)
    leases = [cache.prepare_load(ACME.namespace_id, hs).lease_id for _ in range(4)]
    assert all(leases)  # half of 8: the session-less share
    with pytest.raises(LeaseLimit, match="tenant 'acme'.*session-less.*max_tenant_leases"):
        cache.prepare_load(ACME.namespace_id, hs)
    session = cache.open_session()
    for _ in range(4):  # sessions' leases may use the rest
        assert cache.prepare_load(ACME.namespace_id, hs, session_id=session).lease_id
    with pytest.raises(LeaseLimit, match="max_tenant_leases"):
        cache.prepare_load(ACME.namespace_id, hs, session_id=session)
    other = stored(cache, GLOBEX, "g", 4)  # another tenant is not affected
    assert cache.prepare_load(GLOBEX.namespace_id, other).lease_id
    assert cache.release_load(leases[0])
    assert cache.prepare_load(ACME.namespace_id, hs).lease_id  # room again
    cache.close_session(session)
    assert cache.prepare_load(ACME.namespace_id, hs, session_id=cache.open_session()).lease_id


def test_leased_chunks_are_capped_per_tenant(make_cache: CacheFactory) -> None:
    cache = make_cache(64, max_tenant_leases=1000, max_tenant_leased_chunks=40)
    hs = stored(cache, ACME, "x", 8)
    session = cache.open_session()
    for _ in range(2):  # 16 of 20 session-less chunks
        assert cache.prepare_load(ACME.namespace_id, hs).lease_id
    with pytest.raises(LeaseLimit, match="max_tenant_leased_chunks"):
        cache.prepare_load(ACME.namespace_id, hs)
    for _ in range(3):  # 16 + 24 = 40
        assert cache.prepare_load(ACME.namespace_id, hs, session_id=session).lease_id
    with pytest.raises(LeaseLimit, match="max_tenant_leased_chunks"):
        cache.prepare_load(ACME.namespace_id, hs[:1], session_id=session)
    cache.close_session(session)  # its 24 chunks are given back
    # a miss pins nothing and keeps nothing; what a load did not pin is given back
    session = cache.open_session()
    absent = hashes("absent", 8)
    assert cache.prepare_load(ACME.namespace_id, absent, session_id=session).lease_id is None
    lease = cache.prepare_load(ACME.namespace_id, hs[:2] + absent, session_id=session)
    assert lease.lease_id and len(lease.slots) == 2
    for _ in range(2):  # 16 + 2 + 16 = 34
        assert cache.prepare_load(ACME.namespace_id, hs, session_id=session).lease_id
    assert cache.prepare_load(ACME.namespace_id, hs[:6], session_id=session).lease_id  # 40


def test_expired_leases_give_their_quota_back(make_cache: CacheFactory) -> None:
    cache = make_cache(16, max_tenant_leases=2, max_tenant_leased_chunks=100)
    hs = stored(cache, ACME, "x", 2)
    assert cache.prepare_load(ACME.namespace_id, hs, ttl_s=1).lease_id
    with pytest.raises(LeaseLimit):
        cache.prepare_load(ACME.namespace_id, hs)
    cache.reap_expired(now=FOREVER)
    assert cache.prepare_load(ACME.namespace_id, hs).lease_id

"""Expired shared-memory reservations: the client may still be writing into its view, so the
slot is quarantined (never given to another chunk) until the owner commits, aborts or its
session ends; a late commit publishes nothing; quarantines count against the owner's limit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lmcache_svc.errors import InvalidArgument, ReservationExpired, ReservationLimit
from tests.caches import CacheFactory
from tests.helpers import make_chunk, make_hash, make_namespace, wait_until

NS = make_namespace(chunk_size=256)  # 64 KiB chunks
CHUNK = NS.chunk_bytes
NS_ID = NS.namespace_id
FOREVER = float("inf")


def chunk(name: str) -> bytes:
    return make_chunk(name, CHUNK)


@pytest.fixture
def make_cache() -> Iterator[CacheFactory]:
    # tiny arenas: the tenant's share (tests/cache/test_quotas.py) would refuse first
    with CacheFactory(CHUNK, [NS], max_tenant_reserved_fraction=1.0) as factory:
        yield factory


def test_expired_reservation_slot_is_not_reused_while_its_writer_holds_it(make_cache) -> None:
    cache = make_cache(1)
    a = cache.open_session()
    (prepared,) = cache.prepare_store(NS_ID, [make_hash("a")], session_id=a, ttl_s=1)
    late_writer = cache.view(prepared.slot)  # what a shm client holds: a view of the slot
    assert cache.reap_expired(now=FOREVER) == 1
    b = cache.open_session()
    # the only slot is a's, quarantined: b gets no room rather than a's slot
    assert cache.prepare_store(NS_ID, [make_hash("b")], session_id=b)[0].status == "no_space"
    assert cache.prepare_store(NS_ID, [make_hash("a")], session_id=b)[0].status == "in_progress"
    late_writer[:] = b"\xee" * CHUNK  # the late write lands in a slot nobody else has
    assert cache.commit_store(NS_ID, [make_hash("a")], session_id=a) == 0  # and publishes nothing
    assert cache.get(NS_ID, make_hash("a")) is None
    (prepared_b,) = cache.prepare_store(NS_ID, [make_hash("b")], session_id=b)
    cache.view(prepared_b.slot)[:] = chunk("b")
    assert cache.commit_store(NS_ID, [make_hash("b")], session_id=b) == 1
    assert cache.get(NS_ID, make_hash("b"))[0] == chunk("b")


def test_commit_after_the_deadline_but_before_reaping_publishes_nothing(make_cache) -> None:
    cache = make_cache(2)
    sid = cache.open_session()
    (prepared,) = cache.prepare_store(NS_ID, [make_hash("a")], session_id=sid, ttl_s=1e-6)
    cache.view(prepared.slot)[:] = chunk("a")
    assert cache.commit_store(NS_ID, [make_hash("a")], session_id=sid) == 0
    assert cache.get(NS_ID, make_hash("a")) is None and cache.tiers[0].used_bytes == 0


def test_session_end_releases_its_quarantine(make_cache) -> None:
    cache = make_cache(4, max_reserved_fraction=1.0)
    sid = cache.open_session()
    cache.prepare_store(NS_ID, [make_hash("a"), make_hash("b")], session_id=sid, ttl_s=1)
    cache.reap_expired(now=FOREVER)
    assert cache.tiers[0].used_bytes == 2 * CHUNK and cache.stats().pending_stores == 0
    assert cache.metrics.quarantined_bytes._value.get() == 2 * CHUNK
    cache.close_session(sid)
    assert cache.tiers[0].used_bytes == 0
    assert cache.metrics.quarantined_bytes._value.get() == 0
    assert cache.put(NS_ID, make_hash("a"), chunk("a")) == "reserved"


def test_quarantine_counts_against_the_owners_limit(make_cache) -> None:
    cache = make_cache(4, max_reserved_fraction=0.5)
    sid = cache.open_session()
    cache.prepare_store(NS_ID, [make_hash("a"), make_hash("b")], session_id=sid, ttl_s=1)
    cache.reap_expired(now=FOREVER)
    with pytest.raises(ReservationLimit, match="expired reservations"):
        cache.prepare_store(NS_ID, [make_hash("c")], session_id=sid)
    assert cache.abort_store(NS_ID, [make_hash("a"), make_hash("b")], session_id=sid) == 2
    assert cache.prepare_store(NS_ID, [make_hash("c")], session_id=sid)[0].status == "reserved"


def test_reservation_ttl_is_capped(make_cache) -> None:
    cache = make_cache(2, max_reservation_ttl_s=60.0)
    with pytest.raises(InvalidArgument, match=r"ttl must be in \(0, 60.0\]"):
        cache.prepare_store(NS_ID, [make_hash("a")], session_id="s", ttl_s=600)


def test_inline_put_that_outlives_its_reservation_raises(make_cache) -> None:
    cache = make_cache(2)
    real_view = cache._core.first.view

    def view_then_expire(slot):  # the upload's copy runs past the deadline
        out = real_view(slot)
        cache.reap_expired(now=FOREVER)
        return out

    cache._core.first.view = view_then_expire
    with pytest.raises(ReservationExpired, match="reservation expired"):
        cache.put(NS_ID, make_hash("a"), chunk("a"))
    cache._core.first.view = real_view
    assert cache.get(NS_ID, make_hash("a")) is None and cache.tiers[0].used_bytes == 0


def test_the_maintenance_interval_paces_background_expiry(make_cache) -> None:
    """``cache.maintenance_interval_s`` is when the background thread looks for expired
    reservations: one cache quarantines it within a poll, the other not before its interval."""
    fast = make_cache(1, maintenance_interval_s=0.01)
    slow = make_cache(1, maintenance_interval_s=60.0)
    for cache in (fast, slow):
        cache.start()
        cache.prepare_store(NS_ID, [make_hash("a")], session_id=cache.open_session(), ttl_s=0.05)
    # quarantined by its maintenance thread
    wait_until(lambda: fast.num_pending_stores() == 0, 10, "the fast cache's quarantine")
    assert slow.num_pending_stores() == 1  # its first maintenance step is a minute away
    assert slow.reap_expired() == 1  # expired all the same: only the background pace differs

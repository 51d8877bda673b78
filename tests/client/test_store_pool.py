"""The store pool: slots reserved ahead under placeholder hashes, then bound to the chunks
written into them (``CommitStore`` with ``reserved_as``), against a gRPC server run in this
process (so the test can drive expiry and look inside the cache).

A pooled slot is an ordinary reservation: it counts against its session's limit, expires
and is quarantined, and goes back at session end; a bind after the deadline publishes
nothing; a stalled writer's slot never becomes another chunk's; a placeholder whose chunk
was stored meanwhile stays reserved for the next store.
"""

from __future__ import annotations

import time

import grpc
import pytest

from lmcache_svc import errors
from lmcache_svc.client import CacheClient
from lmcache_svc.client.store_pool import StorePool
from lmcache_svc.v1 import cache_pb2 as pb
from tests.helpers import make_chunk, make_hash, wait_until
from tests.server.inprocess import CHUNK, NS_ID
from tests.server.inprocess import serve as serve  # the fixture
from tests.server.test_put_reservations import stub_for

FOREVER = float("inf")


def filled(client: CacheClient, num: int) -> StorePool:
    pool = StorePool(client, NS_ID, max_slots=num)
    pool.target = num
    assert pool.refill() == num
    return pool


def test_pooled_slots_become_the_chunks_written_into_them(serve) -> None:
    srv = serve(4)
    with CacheClient(srv.socket) as client:
        assert client.shm_available
        pool = filled(client, 2)
        assert srv.cache.num_pending_stores() == 2  # reserved, not stored
        slots = pool.take(2)
        assert len(slots) == 2
        names = ["a", "b"]
        for slot, name in zip(slots, names):
            slot.buffer[:] = make_chunk(name, CHUNK)
        assert pool.bind([make_hash(n) for n in names], slots) == 2
        assert client.load(NS_ID, [make_hash(n) for n in names]) == [
            make_chunk(n, CHUNK) for n in names
        ]
        # the placeholders are gone: nothing of theirs can be looked up or committed
        assert client.lookup(NS_ID, [s.placeholder for s in slots]).num_hit_chunks == 0
        assert client.commit_store(NS_ID, [s.placeholder for s in slots]) == 0
        pool.close()
        assert srv.cache.num_pending_stores() == 0


def test_a_placeholder_whose_chunk_is_stored_already_stays_reserved(serve) -> None:
    srv = serve(4)
    with CacheClient(srv.socket) as client, CacheClient(srv.socket) as other:
        assert other.store(NS_ID, [make_hash("a")], [make_chunk("a", CHUNK)]) == 1
        pool = filled(client, 1)
        (slot,) = pool.take(1)
        slot.buffer[:] = make_chunk("not a", CHUNK)
        assert pool.bind([make_hash("a")], [slot]) == 0
        assert client.load(NS_ID, [make_hash("a")]) == [make_chunk("a", CHUNK)]  # the first kept
        (again,) = pool.take(1)
        assert again is slot  # back at the head of the pool, still reserved
        again.buffer[:] = make_chunk("b", CHUNK)
        assert pool.bind([make_hash("b")], [again]) == 1
        assert client.load(NS_ID, [make_hash("b")]) == [make_chunk("b", CHUNK)]
        pool.close()


def test_bind_after_the_deadline_publishes_nothing_and_never_reuses_the_slot(serve) -> None:
    srv = serve(1)
    with CacheClient(srv.socket) as client:
        pool = filled(client, 1)
        (slot,) = pool.take(1)
        pool.close()  # no refill from here on (the test frees the only slot below)
        assert srv.cache.reap_expired(now=FOREVER) == 1  # quarantined: the writer may write
        with CacheClient(srv.socket) as other:  # the only slot is not given to another chunk
            assert other.store(NS_ID, [make_hash("x")], [make_chunk("x", CHUNK)]) == 0
        slot.buffer[:] = make_chunk("late", CHUNK)
        assert pool.bind([make_hash("late")], [slot]) == 0
        assert client.lookup(NS_ID, [make_hash("late")]).num_hit_chunks == 0
        # the bind gave the quarantined slot back: another chunk can have it now
        with CacheClient(srv.socket) as other:
            assert other.store(NS_ID, [make_hash("x")], [make_chunk("x", CHUNK)]) == 1


def test_another_session_cannot_bind_a_pooled_slot(serve) -> None:
    srv = serve(2)
    with CacheClient(srv.socket) as client, CacheClient(srv.socket) as other:
        pool = filled(client, 1)
        (slot,) = pool.take(1)
        assert other.bind_store(NS_ID, [make_hash("a")], [slot.placeholder]) == (0, [])
        assert other.lookup(NS_ID, [make_hash("a")]).num_hit_chunks == 0
        slot.buffer[:] = make_chunk("a", CHUNK)
        assert pool.bind([make_hash("a")], [slot]) == 1
        pool.close()


def test_pooled_slots_count_against_the_reservation_limit_and_end_with_the_session(
    serve,
) -> None:
    srv = serve(4, max_reserved_fraction=0.5)
    with CacheClient(srv.socket) as client:
        pool = StorePool(client, NS_ID, max_slots=4)
        pool.target = 4
        with pytest.raises(errors.ReservationLimit):
            pool.refill()  # 4 chunks would be the whole arena
        pool.target = 2
        assert pool.refill() == 2
        with pytest.raises(errors.ReservationLimit):
            client.prepare_store(NS_ID, [make_hash("c")])
        assert srv.cache.num_pending_stores() == 2
    # the client closed its session without giving the slots back: the server does
    wait_until(lambda: srv.cache.num_pending_stores() == 0, 10, "the session's slots given back")


def test_bind_needs_one_placeholder_per_chunk_and_no_abort(serve) -> None:
    srv = serve(2)
    with CacheClient(srv.socket) as client:
        pool = filled(client, 1)
        (slot,) = pool.take(1)
        with pytest.raises(errors.InvalidArgument, match="reserved_as"):
            client.bind_store(NS_ID, [make_hash("a"), make_hash("b")], [slot.placeholder])
        channel, stub = stub_for(srv)
        with pytest.raises(grpc.RpcError) as info:
            stub.CommitStore(
                pb.CommitStoreRequest(
                    namespace_id=NS_ID,
                    chunk_hashes=[make_hash("a")],
                    reserved_as=[slot.placeholder],
                    session_id=client.session_id,
                    abort=True,
                ),
                timeout=30,
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        channel.close()
        pool.close()


def test_stale_slots_are_not_handed_out_and_are_given_back(serve) -> None:
    srv = serve(4)
    with CacheClient(srv.socket) as client:
        pool = StorePool(client, NS_ID, max_slots=2, ttl_s=0.2)
        pool.target = 2
        assert pool.refill() == 2
        time.sleep(0.15)  # the behaviour under test: past half the TTL, not handed out any more
        assert pool.take(2) == []
        pool.refill()  # aborts the stale ones, reserves fresh ones (or the refill queued did)
        fresh = pool.take(2)
        assert len(fresh) == 2
        assert all(s.use_by > time.monotonic() for s in fresh)
        pool.abort(fresh)
        pool.close()
        assert srv.cache.num_pending_stores() == 0


def test_the_pool_keeps_two_stores_worth_so_back_to_back_stores_find_slots(serve) -> None:
    srv = serve(8)
    with CacheClient(srv.socket) as client:
        pool = StorePool(client, NS_ID, max_slots=8)
        assert pool.take(2) == []  # empty at first: the store prepares its own
        assert pool.target == 4  # twice the largest take
        assert pool.refill() == 4
        first, second = pool.take(2), pool.take(2)  # before any bind came back
        assert len(first) == len(second) == 2
        for i, slot in enumerate(first + second):
            slot.buffer[:] = make_chunk(f"c{i}", CHUNK)
        hashes = [make_hash(f"c{i}") for i in range(4)]
        assert pool.bind(hashes[:2], first) + pool.bind(hashes[2:], second) == 4
        assert client.load(NS_ID, hashes) == [make_chunk(f"c{i}", CHUNK) for i in range(4)]
        # refilled in the background after the binds
        wait_until(lambda: pool.num_slots == 4, 10, "the pool refilled to 4 slots")
        capped = StorePool(client, NS_ID, max_slots=3)
        capped.take(2)
        assert capped.target == 3  # never past max_slots
        pool.close()
        capped.close()


def test_slots_of_a_failed_bind_are_aborted_not_handed_out_again(serve) -> None:
    srv = serve(4)
    with CacheClient(srv.socket) as client:
        pool = filled(client, 2)
        (slot,) = pool.take(1)
        slot.buffer[:] = make_chunk("a", CHUNK)
        with pytest.raises(errors.InvalidArgument):  # refused: one placeholder for two
            pool.bind([make_hash("a"), make_hash("b")], [slot])
        assert srv.cache.num_pending_stores() == 2  # still reserved on the server
        assert slot not in pool.take(2)  # never handed out again
        pool.target = 0
        pool.refill()  # the next refill gives it back
        assert srv.cache.num_pending_stores() == 1  # the other one, taken just above
        assert client.lookup(NS_ID, [make_hash("a")]).num_hit_chunks == 0
        pool.close()

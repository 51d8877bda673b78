"""Reservations that outlive their deadline, on the inline ``Put`` path and the shared-memory
path, against a gRPC server run in this process (so the test can drive expiry).

A writer whose reservation expired must never write into a slot given to another chunk, and
must learn that nothing was stored; a chunk another client is storing is not "stored"; a
reservation belongs to its session and one session cannot reserve the whole arena.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from lmcache_svc import errors
from lmcache_svc.client import CacheClient
from lmcache_svc.v1 import cache_pb2 as pb
from lmcache_svc.v1 import cache_pb2_grpc as pb_grpc
from tests.helpers import make_chunk, make_hash, wait_until
from tests.server.inprocess import CHUNK, NS_ID, InProcessServer
from tests.server.inprocess import serve as serve  # the fixture


def stub_for(srv: InProcessServer) -> tuple[grpc.Channel, pb_grpc.CacheServiceStub]:
    channel = grpc.insecure_channel(f"unix:{srv.socket}")
    return channel, pb_grpc.CacheServiceStub(channel)


def header(name: str) -> pb.ChunkPart:
    return pb.ChunkPart(
        header=pb.ChunkHeader(namespace_id=NS_ID, chunk_hash=make_hash(name), length=CHUNK)
    )


def test_stalled_put_never_writes_into_a_slot_given_to_another_chunk(serve) -> None:
    # One-chunk arena: once "a"'s reservation expires, "b" can only get a slot if "a"'s
    # slot is given back; "a"'s stalled client then sends its second half.
    srv = serve(1, reservation_ttl_s=0.5)
    channel, stub = stub_for(srv)
    resume = threading.Event()
    bad = b"\xee" * CHUNK

    def stalled_parts() -> Iterator[pb.ChunkPart]:
        yield header("a")
        yield pb.ChunkPart(data=bad[: CHUNK // 2])
        resume.wait(60)
        yield pb.ChunkPart(data=bad[CHUNK // 2 :])

    outcome: dict[str, Any] = {}

    def put_a() -> None:
        try:
            outcome["response"] = stub.Put(stalled_parts(), timeout=60)
        except grpc.RpcError as e:
            outcome["error"] = e

    writer = threading.Thread(target=put_a)
    writer.start()
    wait_until(lambda: srv.cache.num_pending_stores() == 1, 30, "a's reservation")
    with CacheClient(srv.socket, use_shm=False) as client:
        # "b" is stored as soon as the arena has room again (a's slot back in circulation)
        wait_until(
            lambda: client.put(NS_ID, [(make_hash("b"), make_chunk("b", CHUNK))]) == 1,
            60,
            "room for b",
        )
        resume.set()
        writer.join(60)
        assert client.get(NS_ID, [make_hash("b")]) == [make_chunk("b", CHUNK)]
        assert client.get(NS_ID, [make_hash("a")]) == [None]
    assert "response" not in outcome, f"a stalled Put answered {outcome.get('response')}"
    error = outcome["error"]
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "reservation expired" in error.details()
    assert dict(error.trailing_metadata())["lmcache-error-kind"] == "reservation_expired"
    channel.close()


def test_slow_put_that_keeps_sending_is_stored(serve) -> None:
    # 256 MiB at 50 Mbit/s, scaled down: the whole upload takes longer than the reservation's
    # lifetime, but data keeps arriving, so the reservation is extended and the chunk stored.
    srv = serve(2, reservation_ttl_s=2.0)
    channel, stub = stub_for(srv)
    data = make_chunk("slow", CHUNK)
    pieces = 8

    def slow_parts() -> Iterator[pb.ChunkPart]:
        yield header("slow")
        step = CHUNK // pieces
        for i in range(pieces):
            time.sleep(0.5)  # the behaviour under test: a slow upload, longer than the TTL
            yield pb.ChunkPart(data=data[i * step : (i + 1) * step])

    response = stub.Put(slow_parts(), timeout=60)
    assert response.num_stored == 1
    assert srv.cache.get(NS_ID, make_hash("slow"))[0] == data
    channel.close()


def test_put_of_a_chunk_in_progress_elsewhere_is_not_counted_as_stored(serve) -> None:
    srv = serve(4)
    sid = srv.cache.open_session()
    (prepared,) = srv.cache.prepare_store(NS_ID, [make_hash("a")], session_id=sid)
    assert prepared.status == "reserved"
    channel, stub = stub_for(srv)
    parts = [header("a"), pb.ChunkPart(data=make_chunk("a", CHUNK))]
    response = stub.Put(iter(parts), timeout=30)
    assert (response.num_stored, response.num_in_progress) == (0, 1)
    with CacheClient(srv.socket, use_shm=False) as client:
        assert client.put(NS_ID, [(make_hash("a"), make_chunk("a", CHUNK))]) == 0
    channel.close()


def test_session_less_prepare_and_commit_are_refused(serve) -> None:
    srv = serve(4)
    channel, stub = stub_for(srv)
    for call, request in (
        (
            stub.PrepareStore,
            pb.PrepareStoreRequest(namespace_id=NS_ID, chunk_hashes=[make_hash("a")]),
        ),
        (
            stub.CommitStore,
            pb.CommitStoreRequest(namespace_id=NS_ID, chunk_hashes=[make_hash("a")]),
        ),
        (
            stub.CommitStore,
            pb.CommitStoreRequest(namespace_id=NS_ID, chunk_hashes=[make_hash("a")], abort=True),
        ),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "needs the session_id" in info.value.details()
    assert srv.cache.num_pending_stores() == 0
    channel.close()


def test_one_session_cannot_reserve_the_whole_arena_for_long(serve) -> None:
    srv = serve(4, max_reserved_fraction=0.5)
    with CacheClient(srv.socket) as client:
        assert client.shm_available
        hashes = [make_hash(str(i)) for i in range(4)]
        with pytest.raises(errors.ReservationLimit, match="max_reserved_fraction"):
            client.prepare_store(NS_ID, hashes)
        slots = client.prepare_store(NS_ID, hashes[:2])
        assert [s.status for s in slots] == ["reserved", "reserved"]
        with pytest.raises(errors.ReservationLimit):
            client.prepare_store(NS_ID, hashes[2:3])
        # another client still has room
        with CacheClient(srv.socket) as other:
            assert other.store(NS_ID, hashes[2:3], [make_chunk("2", CHUNK)]) == 1
        assert client.commit_store(NS_ID, hashes[:2], abort=True) == 2
    channel, stub = stub_for(srv)
    sid = srv.cache.open_session()
    with pytest.raises(grpc.RpcError) as info:
        stub.PrepareStore(
            pb.PrepareStoreRequest(
                namespace_id=NS_ID, chunk_hashes=hashes[3:], session_id=sid, ttl_ms=600_000
            ),
            timeout=30,
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ttl must be in (0, 120.0]" in info.value.details()
    channel.close()

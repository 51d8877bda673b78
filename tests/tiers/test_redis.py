"""RedisTier against real redis-server processes: format, capacity, TTL, corruption, batches,
start-up scan, cluster and failure handling."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
import xxhash

from lmcache_svc.errors import ConfigError, Corrupted, InvalidArgument, TierError
from lmcache_svc.keys import ChunkKey
from lmcache_svc.tiers.base import Failed, ItemResult
from lmcache_svc.tiers.redis import HEADER, RedisTier
from lmcache_svc_bench.redis_procs import RedisClusterProcs, RedisProc
from tests.helpers import count_calls, count_socket_calls, make_chunk, make_key

KiB = 1 << 10
MiB = 1 << 20


def read(tier: RedisTier, key: ChunkKey, nbytes: int = 4 * KiB) -> bytes | None:
    out = bytearray(nbytes)
    return bytes(out) if tier.read_into(key, memoryview(out)) else None


@pytest.fixture
def make_tier(redis_server: RedisProc) -> Iterator[Callable[..., RedisTier]]:
    """RedisTier factory on the session server, each tier under a fresh key prefix."""
    made: list[RedisTier] = []

    def make(capacity_bytes: int = 64 * MiB, **kwargs: object) -> RedisTier:
        kwargs.setdefault("url", redis_server.url)
        kwargs.setdefault("key_prefix", f"test:{uuid.uuid4().hex}:")
        made.append(RedisTier(capacity_bytes=capacity_bytes, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for tier in made:
        tier.close()


@pytest.fixture
def raw(redis_server: RedisProc) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def rkey(tier: RedisTier, key: ChunkKey) -> bytes:
    return tier._rkey(key)


def raw_value(raw: redis.Redis, name: bytes) -> bytes:
    value = raw.get(name)
    assert isinstance(value, bytes)
    return value


TierFactory = Callable[..., RedisTier]


def test_one_key_per_chunk_with_header(make_tier: TierFactory, raw: redis.Redis) -> None:
    tier = make_tier()
    assert tier.put(make_key(1), make_chunk(1))
    assert raw.keys(tier._prefix + b"*") == [tier._prefix + make_key(1).hex().encode()]
    value = raw_value(raw, rkey(tier, make_key(1)))
    assert len(value) == HEADER.size + 4 * KiB
    magic, version, flags, reserved, length, checksum, key = HEADER.unpack(value[: HEADER.size])
    assert (magic, version, flags, reserved, length) == (b"LMCR", 1, 0, 0, 4 * KiB)
    assert checksum == xxhash.xxh3_64_intdigest(make_chunk(1)) and key == make_key(1)
    assert value[HEADER.size :] == make_chunk(1)


def test_round_trip_and_accounting(make_tier: TierFactory) -> None:
    tier = make_tier()
    assert tier.put(make_key(1), make_chunk(1))
    assert read(tier, make_key(1)) == make_chunk(1)
    assert tier.get(make_key(1)) == make_chunk(1)
    assert tier.size_of(make_key(1)) == 4 * KiB
    assert (tier.used_bytes, tier.num_chunks) == (4 * KiB, 1)
    assert read(tier, make_key(2)) is None and tier.size_of(make_key(2)) is None


def test_overwrite_and_delete(make_tier: TierFactory) -> None:
    tier = make_tier()
    tier.put(make_key(1), make_chunk(1, 4 * KiB))
    assert tier.put(make_key(1), make_chunk(2, 1 * KiB))
    assert read(tier, make_key(1), 1 * KiB) == make_chunk(2, 1 * KiB)
    assert (tier.used_bytes, tier.num_chunks) == (1 * KiB, 1)
    assert tier.delete(make_key(1)) == 1 * KiB
    assert tier.delete(make_key(1)) == 0
    assert (tier.used_bytes, tier.num_chunks) == (0, 0)
    assert read(tier, make_key(1), 1 * KiB) is None


def test_ttl_expiry(make_tier: TierFactory, raw: redis.Redis) -> None:
    tier = make_tier(ttl_s=0.2)
    tier.put(make_key(1), make_chunk(1))
    assert 0 < raw.pttl(rkey(tier, make_key(1))) <= 200
    assert read(tier, make_key(1)) == make_chunk(1)
    time.sleep(0.3)  # the behaviour under test: the TTL runs out
    assert read(tier, make_key(1)) is None
    assert (tier.used_bytes, tier.num_chunks) == (0, 0)  # the vanished key left the accounting


def test_contains_drops_vanished_keys(make_tier: TierFactory, raw: redis.Redis) -> None:
    tier = make_tier()
    tier.put_many([(make_key(i), make_chunk(i)) for i in range(3)])
    raw.delete(rkey(tier, make_key(1)))  # as if Redis evicted it
    assert tier.contains_many([make_key(i) for i in range(3)]) == [True, False, True]
    assert (tier.used_bytes, tier.num_chunks) == (8 * KiB, 2)


def test_capacity_never_exceeded(make_tier: TierFactory, raw: redis.Redis) -> None:
    tier = make_tier(capacity_bytes=10 * KiB)
    got = tier.put_many([(make_key(i), make_chunk(i, 3 * KiB)) for i in range(5)])
    assert got == [True, True, True, False, False]
    assert (tier.used_bytes, tier.num_chunks) == (9 * KiB, 3)
    assert not raw.exists(rkey(tier, make_key(3)))  # a refused put wrote nothing
    assert not tier.put(make_key(0), make_chunk(9, 5 * KiB))  # overwrite too big: old value kept
    assert read(tier, make_key(0), 3 * KiB) == make_chunk(0, 3 * KiB)
    assert tier.put(make_key(0), make_chunk(9, 4 * KiB))  # 3 - 3 + 4 + 6 = 10 KiB fits exactly
    assert tier.used_bytes == 10 * KiB
    assert not tier.put(make_key(7), b"x")
    tier.delete(make_key(1))
    assert tier.put(make_key(7), make_chunk(7, 3 * KiB))


def test_redis_oom_is_no_room(redis_factory: Callable[..., RedisProc]) -> None:
    server = redis_factory(extra_args=("--maxmemory", "4mb", "--maxmemory-policy", "noeviction"))
    tier = RedisTier(server.url, 1 << 30, key_prefix="oom:")
    try:
        results = [tier.put(make_key(i), make_chunk(i, 1 * MiB)) for i in range(8)]
        assert True in results and results[-1] is False
        assert tier.num_chunks == results.count(True)  # refused ones were rolled back
    finally:
        tier.close()


def test_batch_over_redis_maxmemory_counts_exactly_what_redis_holds(
    redis_factory: Callable[..., RedisProc],
) -> None:
    server = redis_factory(extra_args=("--maxmemory", "4mb", "--maxmemory-policy", "noeviction"))
    tier = RedisTier(server.url, 1 << 30, key_prefix="oom-batch:", num_connections=1)
    admin = redis.Redis.from_url(server.url)
    try:
        results = tier.put_many([(make_key(i), make_chunk(i, MiB)) for i in range(8)])
        assert True in results and results[-1] is False  # Redis refused the rest: no room
        assert all(r is True or r is False for r in results)
        held = {n: admin.strlen(n) - HEADER.size for n in admin.keys(b"oom-batch:*")}
        assert len(held) == tier.num_chunks == results.count(True)
        assert sum(held.values()) == tier.used_bytes
        assert sorted(held) == sorted(rkey(tier, make_key(i)) for i, r in enumerate(results) if r)
    finally:
        admin.close()
        tier.close()


def test_flipped_payload_byte_is_corrupted(make_tier: TierFactory, raw: redis.Redis) -> None:
    tier = make_tier()
    tier.put(make_key(1), make_chunk(1))
    name = rkey(tier, make_key(1))
    value = bytearray(raw_value(raw, name))
    value[HEADER.size + 100] ^= 0x01
    raw.set(name, bytes(value))
    with pytest.raises(Corrupted, match=make_key(1).hex()):
        read(tier, make_key(1))
    assert not raw.exists(name)
    assert (tier.used_bytes, tier.num_chunks) == (0, 0)


@pytest.mark.parametrize(
    "damage",
    [
        lambda v: b"garbage",
        lambda v: b"XXXX" + v[4:],  # magic
        lambda v: v[:4] + b"\x09" + v[5:],  # format version
        lambda v: v[:-1],  # truncated
        lambda v: v[:24] + make_key(2) + v[72:],  # names another chunk
    ],
    ids=["garbage", "magic", "version", "truncated", "other-key"],
)
def test_damaged_header_is_corrupted(
    make_tier: TierFactory, raw: redis.Redis, damage: Callable[[bytes], bytes]
) -> None:
    tier = make_tier()
    tier.put(make_key(1), make_chunk(1))
    name = rkey(tier, make_key(1))
    raw.set(name, damage(raw_value(raw, name)))
    with pytest.raises(Corrupted, match=make_key(1).hex()):
        read(tier, make_key(1))
    assert not raw.exists(name)


def test_wrong_buffer_size(make_tier: TierFactory, raw: redis.Redis) -> None:
    tier = make_tier()
    tier.put(make_key(1), make_chunk(1))
    with pytest.raises(InvalidArgument, match="4096"):
        tier.read_into(make_key(1), memoryview(bytearray(4 * KiB + 1)))
    assert raw.exists(rkey(tier, make_key(1)))  # the chunk is fine, the caller was wrong
    with pytest.raises(InvalidArgument):
        tier.read_into(make_key(1), memoryview(bytes(4 * KiB)))  # read-only buffer
    with pytest.raises(InvalidArgument):
        tier.put(ChunkKey(b"short"), b"x")


def test_batches_over_many_connections(make_tier: TierFactory) -> None:
    tier = make_tier(num_connections=4)
    size = 256 * KiB
    items = [(make_key(i), make_chunk(i, size)) for i in range(40)]  # 10 MiB: four shards
    assert tier.put_many(items) == [True] * 40
    keys = [make_key(i) for i in range(44)]
    assert tier.contains_many(keys) == [True] * 40 + [False] * 4
    outs = [memoryview(bytearray(size)) for _ in keys]
    assert tier.read_many_into(list(zip(keys, outs))) == [True] * 40 + [False] * 4
    assert all(bytes(outs[i]) == make_chunk(i, size) for i in range(40))
    assert (tier.used_bytes, tier.num_chunks) == (40 * size, 40)


def test_corrupted_chunk_in_a_batch(make_tier: TierFactory, raw: redis.Redis) -> None:
    tier = make_tier()
    tier.put_many([(make_key(i), make_chunk(i)) for i in range(6)])
    raw.set(rkey(tier, make_key(3)), b"garbage")
    outs = [memoryview(bytearray(4 * KiB)) for _ in range(6)]
    results = tier.read_many_into([(make_key(i), outs[i]) for i in range(6)])
    assert results[:3] + results[4:] == [True] * 5
    assert isinstance(results[3], Failed) and isinstance(results[3].error, Corrupted)
    assert make_key(3).hex() in str(results[3].error)
    assert [bytes(outs[i]) for i in (0, 5)] == [make_chunk(0), make_chunk(5)]
    keys = [make_key(i) for i in range(6)]
    expected = [True, True, True, False, True, True]  # only the corrupted chunk was deleted
    assert tier.contains_many(keys) == expected
    assert tier.read_many_into(list(zip(keys, outs))) == expected


def test_scan_rebuilds_accounting(make_tier: TierFactory, raw: redis.Redis) -> None:
    first = make_tier(key_prefix="scan[1]:")  # glob characters in the prefix are escaped
    first.put_many([(make_key(i), make_chunk(i, (i + 1) * KiB)) for i in range(5)])
    raw.set(b"scan[1]:not-hex", b"x")
    raw.set(b"scan_1_:" + make_key(9).hex().encode(), b"x" * 100)  # matches an unescaped glob
    second = make_tier(key_prefix="scan[1]:")
    assert (second.used_bytes, second.num_chunks) == (0, 0)
    found = dict(second.scan())
    assert found == {make_key(i): (i + 1) * KiB for i in range(5)}
    assert (second.used_bytes, second.num_chunks) == (15 * KiB, 5)
    assert read(second, make_key(2), 3 * KiB) == make_chunk(2, 3 * KiB)


def test_cluster_spreads_keys_over_all_masters(redis_cluster: RedisClusterProcs) -> None:
    tier = RedisTier(redis_cluster.url, 64 * MiB, cluster=True, key_prefix="cluster-test:")
    try:
        items = [(make_key(i), make_chunk(i, 64 * KiB)) for i in range(48)]
        assert tier.put_many(items) == [True] * 48
        for node in redis_cluster.nodes:
            with redis.Redis.from_url(node.url) as client:
                assert client.dbsize() > 0
        keys = [make_key(i) for i in range(50)]
        assert tier.contains_many(keys) == [True] * 48 + [False] * 2
        outs = [memoryview(bytearray(64 * KiB)) for _ in keys]
        assert tier.read_many_into(list(zip(keys, outs))) == [True] * 48 + [False] * 2
        assert all(bytes(outs[i]) == make_chunk(i, 64 * KiB) for i in range(48))
        rescan = RedisTier(redis_cluster.url, 64 * MiB, cluster=True, key_prefix="cluster-test:")
        assert len(dict(rescan.scan())) == 48
        rescan.close()
        assert sum(tier.delete(key) for key in keys) == 48 * 64 * KiB
    finally:
        tier.close()


def assert_fails_fast(call: Callable[[], object], num_timeouts: int) -> None:
    """``call`` fails naming the server, having waited out ``num_timeouts`` socket deadlines
    and slept no back-off (counted, not timed)."""
    with pytest.MonkeyPatch.context() as patch:
        socket_calls = count_socket_calls(patch)
        sleeps = count_calls(patch, time, "sleep")
        with pytest.raises(TierError) as info:
            call()
    assert "127.0.0.1" in str(info.value)
    assert socket_calls, "the call never tried the server"
    assert sum(outcome == "timeout" for _, outcome in socket_calls) == num_timeouts, socket_calls
    assert [s for s in sleeps if s[0] > 0] == [], "the call slept a back-off"


def first_failure(results: list[ItemResult]) -> None:
    """Raise the first failure of a batch: every item must have failed."""
    assert all(isinstance(r, Failed) for r in results), results
    raise next(r.error for r in results if isinstance(r, Failed))


def test_dead_server_fails_fast(redis_factory: Callable[..., RedisProc]) -> None:
    keys = [(i, make_key(i)) for i in range(8)]
    server = redis_factory()
    tier = RedisTier(server.url, 64 * MiB, timeout_s=1.0)
    try:
        assert tier.put(make_key(1), make_chunk(1))
        server.stop()
        assert_fails_fast(lambda: tier.put(make_key(2), make_chunk(2)), 0)
        assert_fails_fast(lambda: read(tier, make_key(1)), 0)
        assert_fails_fast(lambda: tier.contains_many([make_key(1)]), 0)
        assert_fails_fast(
            lambda: first_failure(tier.put_many([(k, make_chunk(i, MiB)) for i, k in keys])),
            0,
        )
    finally:
        tier.close()


def test_hung_server_times_out(redis_factory: Callable[..., RedisProc]) -> None:
    server = redis_factory()
    tier = RedisTier(server.url, 64 * MiB, timeout_s=0.5)
    try:
        assert tier.put(make_key(1), make_chunk(1))
        os.kill(server.process.pid, signal.SIGSTOP)
        assert_fails_fast(lambda: read(tier, make_key(1)), 1)
        assert_fails_fast(lambda: tier.contains_many([make_key(1)]), 1)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        tier.close()


def test_reconnects_after_restart(redis_factory: Callable[..., RedisProc]) -> None:
    server = redis_factory()
    tier = RedisTier(server.url, 64 * MiB, timeout_s=1.0)
    try:
        assert tier.put(make_key(1), make_chunk(1))
        server.stop()
        redis_factory(port=server.port)  # same address, empty (nothing is persisted)
        assert read(tier, make_key(1)) is None
        assert tier.put(make_key(1), make_chunk(1))
        assert read(tier, make_key(1)) == make_chunk(1)
    finally:
        tier.close()


def test_closed_tier_refuses(make_tier: TierFactory) -> None:
    tier = make_tier()
    tier.close()
    with pytest.raises(TierError, match="closed"):
        tier.put(make_key(1), make_chunk(1))


def test_a_scan_the_tier_is_closed_under_stops_with_a_tier_error(make_tier: TierFactory) -> None:
    tier = make_tier()
    assert tier.put_many([(make_key(i), make_chunk(i, 64)) for i in range(1500)]) == [True] * 1500
    scan = tier.scan()  # more than one SCAN batch
    next(scan)
    tier.close()  # a resync's scan runs on its own thread while the server stops
    with pytest.raises(TierError, match="is closed; scan refused"):
        list(scan)  # not carried on over a connection made after the close


def test_a_call_the_tier_is_closed_under_is_a_tier_error_naming_the_close(
    make_tier: TierFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    assert tier.put(make_key(1), make_chunk(1))

    def closed_under_the_read(*args: object) -> Iterator[tuple[ChunkKey, int]]:
        tier.close()
        raise ValueError("I/O operation on closed file.")  # redis-py, its socket shut
        yield  # a generator, as the method it stands for

    monkeypatch.setattr(tier, "_scan_sizes", closed_under_the_read)
    with pytest.raises(TierError, match="was closed during scan: ValueError"):
        list(tier.scan())


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"url": "http://127.0.0.1:6379"}, "http://127.0.0.1:6379"),
        ({"url": "redis://:hunter2@127.0.0.1:notaport"}, "redis://:***@127.0.0.1:notaport"),
        ({"url": "redis://127.0.0.1:6379/x"}, "redis://127.0.0.1:6379/x"),
        ({"url": "unix:///tmp/r.sock", "cluster": True}, "cluster"),
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"ttl_s": 0}, "ttl_s"),
        ({"num_connections": 0}, "num_connections"),
        ({"key_prefix": ""}, "key_prefix"),
        ({"timeout_s": -1}, "timeout_s"),
    ],
)
def test_bad_config(kwargs: dict[str, object], needle: str) -> None:
    args: dict[str, object] = {"url": "redis://127.0.0.1:1", "capacity_bytes": MiB, **kwargs}
    with pytest.raises(ConfigError) as info:
        RedisTier(**args)  # type: ignore[arg-type]
    assert needle in str(info.value) and "hunter2" not in str(info.value)


def test_cluster_redirects_fall_back_to_redis_py(
    redis_cluster: RedisClusterProcs, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = RedisTier(redis_cluster.url, 64 * MiB, cluster=True, key_prefix="moved-test:")
    try:
        client = tier._client
        wrong = client.get_redis_connection(client.get_primaries()[0]).connection_pool
        monkeypatch.setattr(tier, "_pool_of", lambda rkey: wrong)  # most keys answer -MOVED
        items = [(make_key(i), make_chunk(i)) for i in range(12)]
        assert tier.put_many(items) == [True] * 12
        outs = [memoryview(bytearray(4 * KiB)) for _ in items]
        assert tier.read_many_into([(k, o) for (k, _), o in zip(items, outs)]) == [True] * 12
        assert [bytes(o) for o in outs] == [data for _, data in items]
    finally:
        tier.close()


def test_failed_batch_is_not_counted(redis_factory: Callable[..., RedisProc]) -> None:
    server = redis_factory()
    tier = RedisTier(server.url, 64 * MiB, timeout_s=1.0)
    try:
        server.stop()
        results = tier.put_many([(make_key(i), make_chunk(i)) for i in range(4)])
        assert all(isinstance(r, Failed) and "127.0.0.1" in str(r.error) for r in results)
        assert (tier.used_bytes, tier.num_chunks) == (0, 0)
    finally:
        tier.close()

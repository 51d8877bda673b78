"""Lower tiers through the real server: SSD across a restart, Redis shared by two servers."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from lmcache_svc.client import CacheClient
from lmcache_svc.keys import chunk_hashes
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.helpers import make_chunk, wait_until
from tests.server.test_grpc import CHUNK, NS
from tests.tiers.fault_helpers import metric

CHUNKS = 24  # 24 x 64 KiB into a 1 MiB arena: the oldest chunks are evicted


def store_all(address: str) -> list[bytes]:
    hashes = chunk_hashes(NS, list(range(CHUNKS * 256)))
    with CacheClient(address) as c:
        ns_id = c.register_namespace(NS)
        for i, h in enumerate(hashes):
            assert c.store(ns_id, [h], [make_chunk(i, CHUNK)]) == 1
    return hashes


def test_ssd_tier_keeps_demoted_chunks_across_a_restart(tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    args = ("--cpu-bytes", "1MiB", "--ssd-path", str(ssd), "--ssd-bytes", "64MiB")
    first = start_server(tmp_path, *args)
    try:
        hashes = store_all(first.socket)
        with CacheClient(first.socket) as c:
            tiers = c.lookup(c.register_namespace(NS), hashes).tiers
        assert len(tiers) == CHUNKS and tiers[0] == "ssd" and tiers[-1] == "cpu"
        num_on_ssd = tiers.count("ssd")
        assert first.stop() == 0
    finally:
        first.cleanup()
    second = start_server(tmp_path, *args)
    try:
        with CacheClient(second.socket) as c:
            ns_id = c.register_namespace(NS)
            found = c.lookup(ns_id, hashes)
            assert found.num_hit_chunks == num_on_ssd and set(found.tiers) == {"ssd"}
            assert found.media == ["disk"] * num_on_ssd  # what the engine reports hits by
            got = c.load(ns_id, hashes[:4])  # promoted into the new arena
            assert got == [make_chunk(i, CHUNK) for i in range(4)]
            promoted = c.lookup(ns_id, hashes[:4])
            assert promoted.tiers == ["cpu"] * 4 and promoted.media == ["host_memory"] * 4
        metrics = httpx.get(f"{second.http_url}/metrics", timeout=5).text
        assert 'lmcache_svc_promotions_total{tier="cpu"} 4.0' in metrics
    finally:
        second.cleanup()


def test_two_servers_share_chunks_through_redis(tmp_path: Path, redis_server) -> None:
    args = ("--redis-url", redis_server.url, "--redis-bytes", "256MiB")
    env = {"LMCACHE_SVC_REDIS__KEY_PREFIX": f"e2e-{time.monotonic_ns()}:"}
    a = start_server(tmp_path, *args, env=env)
    b = start_server(tmp_path, *args, env=env)
    try:
        hashes = chunk_hashes(NS, list(range(4 * 256)))
        with CacheClient(a.socket) as ca:
            ca.store(ca.register_namespace(NS), hashes, [make_chunk(i, CHUNK) for i in range(4)])
        with CacheClient(b.socket) as cb:
            ns_id = cb.register_namespace(NS)
            wait_until(  # write-through is asynchronous
                lambda: cb.lookup(ns_id, hashes).num_hit_chunks == 4, 10, "a's chunks in Redis"
            )
            remote = cb.lookup(ns_id, hashes)
            assert remote.tiers == ["redis"] * 4 and remote.media == ["remote"] * 4
            assert cb.load(ns_id, hashes) == [make_chunk(i, CHUNK) for i in range(4)]
            assert cb.lookup(ns_id, hashes).tiers == ["cpu"] * 4
    finally:
        a.cleanup()
        b.cleanup()


def redis_failures(server: ServerProc) -> float:
    return metric(server, "lmcache_svc_tier_errors_total", tier="redis", kind="tier_unavailable")


def test_a_dead_redis_is_a_miss_not_a_failure(tmp_path: Path, redis_factory) -> None:
    redis = redis_factory()
    server = start_server(
        tmp_path, "--redis-url", redis.url, env={"LMCACHE_SVC_REDIS__TIMEOUT_S": "0.5"}
    )
    try:
        redis.stop()
        hashes = chunk_hashes(NS, list(range(3 * 256)))
        with CacheClient(server.socket, timeout_s=10) as c:
            ns_id = c.register_namespace(NS)
            assert (
                c.store(
                    ns_id,
                    hashes[:2],
                    [make_chunk(0, CHUNK), make_chunk(1, CHUNK)],
                )
                == 2
            )
            failed_before = redis_failures(server)
            found = c.lookup(ns_id, hashes)
            assert found.num_hit_chunks == 2
            # a miss at once: at most one failed call to the dead Redis, no retries
            assert redis_failures(server) - failed_before <= 1
            assert c.load(ns_id, hashes) == [
                make_chunk(0, CHUNK),
                make_chunk(1, CHUNK),
            ]
        metrics = httpx.get(f"{server.http_url}/metrics", timeout=5).text
        assert 'lmcache_svc_errors_total{kind="tier_unavailable"}' in metrics
        assert 'lmcache_svc_tier_errors_total{kind="tier_unavailable",tier="redis"}' in metrics
    finally:
        server.cleanup()

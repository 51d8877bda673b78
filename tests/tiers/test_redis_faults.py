"""A real redis-server hung (SIGSTOP), killed and restarted under traffic of a real server.

The bounds on durations are generous (half the Redis timeout): they catch calls queueing
behind a hung Redis, they do not measure speed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lmcache_svc.client import CacheClient
from lmcache_svc.keys import chunk_hashes
from lmcache_svc_bench.procs import ServerProc, start_server
from lmcache_svc_bench.redis_procs import RedisProc, send_command
from tests.helpers import make_chunk, wait_until
from tests.server.test_grpc import CHUNK, NS
from tests.tiers.fault_helpers import metric, redis_holds, tier_stats

REDIS_TIMEOUT_S = 6.0
BOUND_S = REDIS_TIMEOUT_S / 2


def redis_server(tmp_path: Path, redis: RedisProc, *, workers: int = 16) -> ServerProc:
    return start_server(
        tmp_path,
        "--redis-url",
        redis.url,
        env={
            "LMCACHE_SVC_REDIS__TIMEOUT_S": str(REDIS_TIMEOUT_S),
            "LMCACHE_SVC_REDIS__BREAKER_MAX_BACKOFF_S": "2",
            "LMCACHE_SVC_GRPC_WORKERS": str(workers),
        },
    )


def hashes_for(first_token: int, num: int) -> list[bytes]:
    return [bytes(h) for h in chunk_hashes(NS, list(range(first_token, first_token + num * 256)))]


class Traffic:
    """Client threads looping over an operation, recording (start, duration, error)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.records: dict[str, list[tuple[float, float, str]]] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def run(self, name: str, op: Callable[[int], None]) -> None:
        def loop() -> None:
            i = 0
            while not self.stop.is_set():
                start = time.monotonic()
                error = ""
                try:
                    op(i)
                except Exception as e:  # recorded; the test asserts there are none
                    error = f"{type(e).__name__}: {e}"
                with self._lock:
                    self.records.setdefault(name, []).append(
                        (start, time.monotonic() - start, error)
                    )
                i += 1

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        self._threads.append(thread)

    def join(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(60)

    def since(self, name: str, t0: float) -> list[tuple[float, float, str]]:
        with self._lock:
            return [r for r in self.records.get(name, []) if r[0] >= t0]


def test_a_hung_redis_is_marked_down_and_arena_work_never_waits(
    tmp_path: Path, redis_factory: Callable[..., RedisProc]
) -> None:
    redis = redis_factory()
    # More loaders than worker threads: before the fix, arena-only calls queued behind them.
    server = redis_server(tmp_path, redis, workers=2)
    traffic = Traffic()
    stopped = False
    try:
        warm = hashes_for(0, 8)
        with CacheClient(server.socket, timeout_s=30) as setup:
            ns_id = setup.register_namespace(NS)
            assert setup.store(ns_id, warm, [make_chunk(i, CHUNK) for i in range(8)]) == 8

        def loader(seed: int) -> Callable[[int], None]:
            client = CacheClient(server.socket, timeout_s=30)
            client.register_namespace(NS)

            def op(i: int) -> None:  # misses: every one asks Redis
                missing = hashes_for(1_000_000 * (seed + 1) + i * 256, 2)
                assert client.lookup(ns_id, missing).num_hit_chunks == 0
                assert client.load(ns_id, missing) == []

            return op

        arena = CacheClient(server.socket, timeout_s=30)
        arena.register_namespace(NS)

        def store_new(i: int) -> None:
            h = hashes_for(10_000_000 + i * 256, 1)
            assert arena.store(ns_id, h, [make_chunk(i, CHUNK)]) == 1

        def load_warm(i: int) -> None:  # loads keep the warm chunks in the arena's LRU front
            assert arena.lookup(ns_id, warm).num_hit_chunks == 8
            assert arena.load(ns_id, warm) == [make_chunk(j, CHUNK) for j in range(8)]

        for seed in range(6):
            traffic.run(f"loader{seed}", loader(seed))
        traffic.run("store", store_new)
        traffic.run("load", load_warm)
        names = ["store", "load", *(f"loader{seed}" for seed in range(6))]
        wait_until(
            lambda: all(traffic.since(name, 0.0) for name in names), 60, "traffic on every thread"
        )

        os.kill(redis.process.pid, signal.SIGSTOP)
        stopped = True
        hung_at = time.monotonic()
        wait_until(
            lambda: metric(server, "lmcache_svc_tier_breaker_trips_total", tier="redis") >= 1,
            3 * REDIS_TIMEOUT_S,
            "the breaker to trip",
        )
        tripped_at = time.monotonic()
        # Traffic against the hung Redis until every loader got past the call it had out when
        # Redis hung (that one waited out the timeout) and the arena work kept going meanwhile.
        wait_until(
            lambda: (
                all(len(traffic.since(f"loader{s}", tripped_at + 0.5)) >= 2 for s in range(6))
                and all(len(traffic.since(name, hung_at)) >= 5 for name in ("store", "load"))
            ),
            6 * REDIS_TIMEOUT_S,
            "every loader past the hung Redis, and arena work meanwhile",
        )
        measured_until = time.monotonic()

        for name in ("store", "load"):  # arena-only work, from the moment Redis hung
            done = traffic.since(name, hung_at)
            assert len(done) >= 5, f"{name}: only {len(done)} calls while Redis hung"
            assert all(not err for _, _, err in done), [e for e in done if e[2]]
            slowest = max(d for _, d, _ in done)
            assert slowest < BOUND_S, f"{name} waited {slowest:.1f} s behind the hung Redis"
        # Lookups and loads of misses: quick once the tier is marked down.
        after_trip = [
            r for s in range(6) for r in traffic.since(f"loader{s}", tripped_at + 0.5)
            if r[0] < measured_until
        ]  # fmt: skip
        assert len(after_trip) >= 10
        assert all(not err for _, _, err in after_trip), after_trip
        slowest = max(d for _, d, _ in after_trip)
        assert slowest < BOUND_S, f"a miss took {slowest:.1f} s with Redis marked down"
        assert metric(server, "lmcache_svc_tier_breaker_state", tier="redis") in (1, 2)
        assert metric(server, "lmcache_svc_tier_skipped_calls_total", tier="redis", op="contains")

        os.kill(redis.process.pid, signal.SIGCONT)
        stopped = False
        wait_until(
            lambda: metric(server, "lmcache_svc_tier_breaker_state", tier="redis") == 0,
            60,
            "the tier to come back by itself",
        )
        # Back in use: a new chunk is written through to the real Redis again.
        before = redis_holds(redis.url)["num_chunks"]
        store_new(999_999)
        wait_until(
            lambda: redis_holds(redis.url)["num_chunks"] > before,
            60,
            "write-through to reach Redis again",
        )
    finally:
        if stopped:
            os.kill(redis.process.pid, signal.SIGCONT)
        traffic.join()
        server.cleanup()


def _store(server: ServerProc, first: int, num: int) -> list[bytes]:
    hashes = hashes_for(first * 256, num)
    with CacheClient(server.socket, timeout_s=30) as c:
        ns_id = c.register_namespace(NS)
        assert c.store(ns_id, hashes, [make_chunk(first + i, CHUNK) for i in range(num)]) == num
    return hashes


def _stats_agree(server: ServerProc, redis: RedisProc) -> bool:
    return tier_stats(server, "redis") == redis_holds(redis.url)


def _outage_traffic(server: ServerProc, warm: list[bytes], arena: Traffic, probe: Traffic) -> None:
    """Arena stores and loads, and lookups of misses (which probe Redis)."""
    client = CacheClient(server.socket, timeout_s=30)
    ns_id = client.register_namespace(NS)

    def arena_work(i: int) -> None:
        assert client.load(ns_id, warm) == [make_chunk(j, CHUNK) for j in range(len(warm))]
        new = hashes_for(50_000_000 + i * 256, 1)
        assert client.store(ns_id, new, [make_chunk(i, CHUNK)]) == 1

    def lookup_miss(i: int) -> None:
        assert client.lookup(ns_id, hashes_for(90_000_000 + i * 256, 1)).num_hit_chunks == 0
        time.sleep(0.05)  # paces the probes (a rate, not a wait for something)

    arena.run("arena", arena_work)
    probe.run("probe", lookup_miss)


@pytest.mark.parametrize("saved", [False, True], ids=["restarted-empty", "restarted-from-rdb"])
def test_redis_killed_and_restarted_comes_back_and_stats_match_redis(
    tmp_path: Path, redis_factory: Callable[..., RedisProc], saved: bool
) -> None:
    redis = redis_factory()
    server = redis_server(tmp_path, redis)
    arena, probe = Traffic(), Traffic()
    try:
        warm = _store(server, 0, 10)
        wait_until(lambda: _stats_agree(server, redis), 60, "write-through of the first chunks")
        if saved:  # the snapshot a restarted Redis will load: these 10 chunks
            assert send_command(redis.port, "SAVE", timeout_s=10).startswith(b"+OK")
        _store(server, 100, 10)
        wait_until(lambda: _stats_agree(server, redis), 60, "write-through of the next chunks")
        assert tier_stats(server, "redis")["num_chunks"] == 20

        _outage_traffic(server, warm[:4], arena, probe)
        redis.stop()  # SIGKILL
        wait_until(
            lambda: metric(server, "lmcache_svc_tier_breaker_trips_total", tier="redis") >= 1,
            60,
            "the breaker to trip on the dead Redis",
        )
        tripped_at = time.monotonic()
        wait_until(  # the arena keeps serving meanwhile, and misses keep probing
            lambda: (
                len(arena.since("arena", tripped_at)) >= 5
                and len(probe.since("probe", tripped_at)) >= 5
            ),
            60,
            "arena work and probes after the trip",
        )
        arena.join()
        probe.join()
        for name, records in [*arena.records.items(), *probe.records.items()]:
            assert len(records) >= 5, f"{name}: only {len(records)} calls during the outage"
            assert all(not err for _, _, err in records), [r for r in records if r[2]][:3]

        redis = redis_factory(port=redis.port)  # same port and directory: loads dump.rdb
        expected = 10 if saved else 0
        assert redis_holds(redis.url)["num_chunks"] == expected
        # No traffic now: the server's own probe brings Redis back.
        wait_until(
            lambda: (
                metric(server, "lmcache_svc_tier_breaker_state", tier="redis") == 0
                and _stats_agree(server, redis)
            ),
            60,
            "the tier to come back and its stats to match Redis",
        )
        assert metric(server, "lmcache_svc_tier_resyncs_total", tier="redis") >= 1
        # Chunks stored during the outage were not written through; new ones are again.
        _store(server, 200, 5)
        wait_until(lambda: _stats_agree(server, redis), 60, "write-through after the restart")
        assert redis_holds(redis.url)["num_chunks"] == expected + 5
    finally:
        arena.join()
        probe.join()
        server.cleanup()


def test_a_redis_restarted_between_calls_is_noticed(
    tmp_path: Path, redis_factory: Callable[..., RedisProc]
) -> None:
    """No call fails (the restart happens while the server is idle, and a dropped connection
    is retried): the new run_id alone must make the index follow the empty Redis."""
    redis = redis_factory()
    server = redis_server(tmp_path, redis)
    try:
        _store(server, 0, 10)
        wait_until(lambda: _stats_agree(server, redis), 60, "write-through")
        assert tier_stats(server, "redis")["num_chunks"] == 10
        redis.stop()
        redis = redis_factory(port=redis.port)
        with CacheClient(server.socket, timeout_s=30) as c:  # one call that reaches Redis
            ns_id = c.register_namespace(NS)
            assert c.lookup(ns_id, hashes_for(70_000_000, 1)).num_hit_chunks == 0
        wait_until(
            lambda: _stats_agree(server, redis), 60, "the stats to match the restarted Redis"
        )
        assert tier_stats(server, "redis")["num_chunks"] == 0
        assert metric(server, "lmcache_svc_tier_breaker_trips_total", tier="redis") == 0
    finally:
        server.cleanup()


def test_chunks_only_in_a_tier_marked_down_are_misses(
    tmp_path: Path, redis_factory: Callable[..., RedisProc]
) -> None:
    """A lookup must not promise chunks a load cannot get while their tier is down."""
    redis = redis_factory()
    server = start_server(
        tmp_path, "--cpu-bytes", "1MiB", "--redis-url", redis.url,
        env={"LMCACHE_SVC_REDIS__TIMEOUT_S": "1", "LMCACHE_SVC_REDIS__BREAKER_BACKOFF_S": "60",
             "LMCACHE_SVC_REDIS__BREAKER_MAX_BACKOFF_S": "60"},
    )  # fmt: skip
    try:
        hashes = hashes_for(0, 24)  # 24 x 64 KiB through a 1 MiB arena: the first evicted
        with CacheClient(server.socket, timeout_s=30) as c:
            ns_id = c.register_namespace(NS)
            for i, h in enumerate(hashes):
                assert c.store(ns_id, [h], [make_chunk(i, CHUNK)]) == 1
            assert c.lookup(ns_id, hashes[:1]).tiers == ["redis"]
            redis.stop()
            assert c.lookup(ns_id, hashes_for(80_000_000, 1)).num_hit_chunks == 0  # trips it
            wait_until(
                lambda: metric(server, "lmcache_svc_tier_breaker_state", tier="redis") == 1,
                60,
                "the breaker to trip",
            )
            assert c.lookup(ns_id, hashes[:1]).num_hit_chunks == 0
            assert c.load(ns_id, hashes[:1]) == []
    finally:
        server.cleanup()

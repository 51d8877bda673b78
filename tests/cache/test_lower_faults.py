"""The lower tiers under a real redis-server's faults: a hung Redis never makes a caller
wait on a probe, writes Redis refuses for memory are counted, and a promotion that a
restarted (empty) Redis cannot serve evicts nothing from the arena.

Bounds on durations are half the Redis timeout, as in tests/tiers/test_redis_faults.py: they
catch a caller waiting on the hung Redis, they do not measure speed."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import pytest

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.lower_tier_manager import LowerTierManager
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.cache.values import TierPolicy
from lmcache_svc.metrics import Metrics
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.cpu import CpuTier
from lmcache_svc.tiers.redis import RedisTier
from lmcache_svc_bench.redis_procs import RedisProc
from tests.helpers import make_chunk, make_key, make_namespace, wait_until

REDIS_TIMEOUT_S = 2.0
BOUND_S = REDIS_TIMEOUT_S / 2


def in_thread(fn: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_a_caller_never_waits_on_the_probe_of_a_hung_redis(
    redis_factory: Callable[..., RedisProc],
) -> None:
    redis = redis_factory()
    tier = RedisTier(redis.url, 1 << 30, key_prefix="probe:", timeout_s=REDIS_TIMEOUT_S)
    policy = TierPolicy(accept_demotions=True, backoff_s=0.05, max_backoff_s=0.1, slow_call_s=0.2)
    lower = LowerTierManager([(tier, policy)], Metrics())
    breaker = lower._tiers[0].breaker
    keys = [make_key(i) for i in range(4)]
    os.kill(redis.process.pid, signal.SIGSTOP)
    try:
        first = in_thread(lambda: lower.sources(keys))  # waits its timeout: the detection
        wait_until(lambda: breaker.state != "closed", 30, "the breaker to trip")
        first.join(REDIS_TIMEOUT_S * 3)
        for _ in range(2):  # past each backoff: the probe runs in the background
            wait_until(breaker.probe_due, REDIS_TIMEOUT_S * 3, "the backoff to pass")
            caller = in_thread(lambda: lower.sources(keys))
            caller.join(BOUND_S)
            assert not caller.is_alive(), "a caller waited on the hung Redis (it probed)"
            assert breaker.state == "half_open"  # the probe, in flight on its own thread
    finally:
        os.kill(redis.process.pid, signal.SIGCONT)
    # callers keep answering at once and start probes; one finds Redis back
    wait_until(
        lambda: _asked(lower, keys) == "closed", 30, "a background probe to bring Redis back"
    )
    wait_until(lambda: not lower._probing, 30, "the probes to end")
    lower.close()


def _asked(lower: LowerTierManager, keys: list) -> str:
    lower.sources(keys)
    return lower._tiers[0].breaker.state


def test_writes_redis_refuses_for_memory_are_counted(
    redis_factory: Callable[..., RedisProc],
) -> None:
    redis = redis_factory(extra_args=("--maxmemory", "4mb", "--maxmemory-policy", "noeviction"))
    tier = RedisTier(redis.url, 1 << 30, key_prefix="oom:")
    metrics = Metrics()
    lower = LowerTierManager([(tier, TierPolicy(accept_demotions=True))], metrics)
    for i in range(8):
        lower.demote(make_key(i), memoryview(make_chunk(i, 1 << 20)))
    refused = metrics.tier_errors.labels(tier=tier.name, kind="refused")._value.get()
    assert refused >= 1, "Redis refused writes (maxmemory) and nothing was counted"
    assert tier.num_chunks < 8
    lower.close()


def test_a_resync_the_tiers_are_closed_under_ends_quietly(
    redis_factory: Callable[..., RedisProc], caplog: pytest.LogCaptureFixture
) -> None:
    redis = redis_factory()
    tier = RedisTier(redis.url, 1 << 30, key_prefix="resync:")
    metrics = Metrics()
    lower = LowerTierManager([(tier, TierPolicy(accept_demotions=True))], metrics)
    lower.close()
    lower._resync(lower._tiers[0])  # the resync thread's body, its scan refused by the close
    assert metrics.tier_errors.labels(tier=tier.name, kind="tier_unavailable")._value.get() == 0
    assert "failed" not in caplog.text
    assert lower._tiers[0].breaker.state == "closed"  # a stopping server marks nothing down


NS = make_namespace(chunk_size=256)
CHUNK_BYTES = NS.chunk_bytes
HASHES = [bytes([i]) * 32 for i in range(1, 17)]


def cache_over_redis(redis: RedisProc, prefix: str) -> TieredCache:
    """An 8-chunk arena over a Redis tier, 16 chunks stored: the first 8 demoted to Redis."""
    arena = Arena.create(8 * CHUNK_BYTES, slab_bytes=CHUNK_BYTES, prefault="off")
    tier = RedisTier(redis.url, 1 << 30, key_prefix=prefix, timeout_s=REDIS_TIMEOUT_S)
    cache = TieredCache(
        CpuTier(arena),
        [(tier, TierPolicy(accept_demotions=True, write_through=False))],
        settings=CacheSettings(high_watermark=1.0, low_watermark=0.5),
    )
    cache.register_namespace(NS)
    for i, h in enumerate(HASHES):
        assert cache.put(NS.namespace_id, h, make_chunk(i, CHUNK_BYTES)) == "reserved"
    cache.flush()
    return cache


def test_a_promotion_a_restarted_redis_cannot_serve_evicts_nothing(
    redis_factory: Callable[..., RedisProc],
) -> None:
    redis = redis_factory()
    cache = cache_over_redis(redis, "promote:")
    try:
        arena_held = HASHES[8:]
        assert cache.first_tier_holds(NS.namespace_id, arena_held)
        evictions = cache.metrics.evictions.labels(tier="cpu")._value.get()

        redis.stop()  # Redis restarts empty on the same port; the tier still lists 8 chunks
        redis_factory(port=redis.port)
        lease = cache.prepare_load(NS.namespace_id, HASHES[:8])
        assert lease.lease_id is None  # nothing could be read
        assert cache.metrics.evictions.labels(tier="cpu")._value.get() == evictions
        assert cache.first_tier_holds(NS.namespace_id, arena_held)  # nothing evicted for it
        got = cache.get(NS.namespace_id, arena_held[0])
        assert got is not None and got[0] == make_chunk(8, CHUNK_BYTES)
        resyncs = cache.metrics.resyncs.labels(tier="redis")
        wait_until(
            lambda: resyncs._value.get() >= 1, 30, "the index rebuild of the restarted Redis"
        )
    finally:
        cache.close()


def test_promotion_into_a_full_arena_still_works_once_the_bytes_are_read(
    redis_factory: Callable[..., RedisProc],
) -> None:
    cache = cache_over_redis(redis_factory(), "promote-ok:")
    try:
        lease = cache.prepare_load(NS.namespace_id, HASHES[:4])  # arena full: staged, evicting
        assert lease.lease_id is not None and len(lease.slots) == 4
        got = [bytes(cache.view(s)) for s in lease.slots]
        assert got == [make_chunk(i, CHUNK_BYTES) for i in range(4)]
        cache.release_load(lease.lease_id)
    finally:
        cache.close()

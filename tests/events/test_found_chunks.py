"""Chunks a server did not store since it started, announced from the descriptions stored
with their values: an SSD tier's files after a restart (``STORAGE``/``LOCAL``), and a shared
Redis another server wrote to before this one started (``STORAGE``/``REMOTE``)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.values import TierPolicy
from lmcache_svc.keys import chunk_hash_packed, chunk_hashes, make_chunk_key
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.events.format import BlockStored
from lmcache_svc.server.events.metrics import EventMetrics
from lmcache_svc.server.events.node_stream import NodeEvents, block_hashes
from lmcache_svc.server.events.settings import EventsSettings
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.base import ChunkDescription, Tier
from lmcache_svc.tiers.cpu import CpuTier
from lmcache_svc.tiers.redis import RedisTier
from lmcache_svc.tiers.ssd import SsdTier
from lmcache_svc_bench.redis_procs import RedisProc
from tests.events.streams import Subscriber
from tests.helpers import make_chunk, make_layout, make_namespace, wait_until

NS = make_namespace(chunk_size=16, layout=make_layout(block_size=16))
CHUNK = NS.chunk_bytes
THROUGH = TierPolicy(write_through=True, backoff_s=0.2, max_backoff_s=0.5)


@contextmanager
def node(
    tmp: Path, name: str, lower: Tier, *, register: bool = True, start: bool = True
) -> Iterator[tuple[TieredCache, NodeEvents, Subscriber]]:
    """A cache with events on over ``lower`` (written through), its stream subscribed
    before the namespace is registered; ``start=False``: no maintenance thread (a tier
    marked down is probed only when a call finds it skipped)."""
    settings = EventsSettings(
        enabled=True, endpoint=f"ipc://{tmp}/{name}-pub", replay_endpoint=None, node=name
    )
    metrics = Metrics()
    events = NodeEvents(settings, EventMetrics(metrics.registry))
    arena = Arena.create(8 * CHUNK, slab_bytes=CHUNK, prefault="off")
    cache = TieredCache(CpuTier(arena), [(lower, THROUGH)], metrics=metrics, listener=events)
    if start:
        cache.start()
    sub = Subscriber(events.publisher.endpoint)
    sub.drain(200)
    if register:
        cache.register_namespace(NS)
    try:
        yield cache, events, sub
    finally:
        sub.close()
        cache.close()
        events.close()


def store_chain(cache: TieredCache, seed: int, num_chunks: int) -> tuple[list[bytes], np.ndarray]:
    tokens = np.random.default_rng(seed).integers(0, 30_000, num_chunks * NS.chunk_size)
    hashes = chunk_hashes(NS, tokens)
    for i, h in enumerate(hashes):
        part = tokens[i * NS.chunk_size : (i + 1) * NS.chunk_size].astype("<u4").tobytes()
        cache.put(
            NS.namespace_id, h, make_chunk(h.hex(), CHUNK),
            token_ids=part, parent_hash=hashes[i - 1] if i else b"",
        )  # fmt: skip
    assert cache.flush()  # the write-through copies are stored
    return hashes, tokens


def storage(events: list, locality: str) -> list[BlockStored]:
    return [
        e for e in events
        if isinstance(e, BlockStored) and e.medium == "STORAGE" and e.locality == locality
    ]  # fmt: skip


def check_chain(got: list[BlockStored], hashes: list[bytes], tokens: np.ndarray) -> None:
    assert [e.block_hashes for e in got] == [block_hashes(h, 1) for h in hashes]
    assert [e.token_ids for e in got] == tokens.reshape(len(hashes), -1).tolist()
    assert got[0].parent_block_hash is None
    assert [e.parent_block_hash for e in got[1:]] == [e.block_hashes[-1] for e in got[:-1]]


def test_a_restarted_ssd_tier_announces_the_chunks_it_still_holds(tmp_path: Path) -> None:
    ssd_dir = tmp_path / "ssd"
    with node(tmp_path, "before", SsdTier(ssd_dir, 64 * (CHUNK + 4096))) as (cache, _, sub):
        hashes, tokens = store_chain(cache, 1, 3)
        sub.wait_for(lambda ev: len(storage(ev, "LOCAL")) == 3)
    with node(tmp_path, "after", SsdTier(ssd_dir, 64 * (CHUNK + 4096))) as (cache, _, sub):
        got = storage(sub.wait_for(lambda ev: len(storage(ev, "LOCAL")) == 3), "LOCAL")
        check_chain(got, hashes, tokens)
        for h in hashes:  # and they load from the SSD
            assert cache.get(NS.namespace_id, h) == (make_chunk(h.hex(), CHUNK), "ssd")


def test_a_node_that_starts_late_announces_what_another_wrote_to_redis(
    redis_server: RedisProc, tmp_path: Path
) -> None:
    prefix = f"late-{secrets.token_hex(4)}:"

    def tier() -> RedisTier:
        return RedisTier(redis_server.url, 64 * CHUNK, key_prefix=prefix, timeout_s=2.0)

    with node(tmp_path, "a", tier()) as (cache_a, _, _):
        hashes, tokens = store_chain(cache_a, 2, 3)
        with node(tmp_path, "b", tier()) as (cache_b, _, sub_b):  # after A's writes
            got = storage(sub_b.wait_for(lambda ev: len(storage(ev, "REMOTE")) == 3), "REMOTE")
            check_chain(got, hashes, tokens)
            assert cache_b.get(NS.namespace_id, hashes[2]) == (
                make_chunk(hashes[2].hex(), CHUNK),
                "redis",
            )


HALF = np.arange(NS.chunk_size // 2, dtype="<u4").tobytes()
FULL = np.arange(NS.chunk_size, dtype="<u4").tobytes()


@pytest.mark.parametrize(
    ("tokens", "hashed", "why"),
    [
        (HALF, HALF, "holds 8 token ids, its namespace's chunks 16"),
        (FULL, FULL[::-1], "its token ids and parent do not hash to it"),
    ],
    ids=["wrong-token-count", "not-its-tokens"],
)
def test_a_stored_description_that_is_not_the_chunks_is_refused_by_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, tokens: bytes, hashed: bytes, why: str
) -> None:
    """A description of half a chunk's tokens (hashing truly to the key), or of tokens that
    are not the chunk's: the tier keeps the chunk, the events refuse the description,
    naming the chunk."""
    key = make_chunk_key(NS.namespace_id, chunk_hash_packed(NS.namespace_id, hashed))
    ssd = SsdTier(tmp_path / "ssd", 64 * (CHUNK + 4096))
    ssd.describe = lambda k: ChunkDescription(NS.namespace_id, tokens)
    assert ssd.put(key, make_chunk(1, CHUNK))
    ssd.close()
    with (
        caplog.at_level(logging.WARNING),
        node(tmp_path, "n", SsdTier(tmp_path / "ssd", 64 * (CHUNK + 4096)), register=False) as (
            cache,
            events,
            sub,
        ),
    ):
        cache.register_namespace(NS)
        sub.drain(300)
        assert storage(sub.events(), "LOCAL") == []
        unannounced = events.metrics.unannounced.labels(reason="bad_description")
        assert unannounced._value.get() == 1
        assert cache.get(NS.namespace_id, key[16:]) == (make_chunk(1, CHUNK), "ssd")
    refusals = [r.getMessage() for r in caplog.records if key.hex() in r.getMessage()]
    assert len(refusals) == 1 and why in refusals[0]


def test_a_redis_resync_announces_what_another_node_wrote_unheard(
    redis_server: RedisProc, tmp_path: Path
) -> None:
    """B runs without the announce channel (as if it missed A's messages); when its Redis
    tier is resynced (its generation changed: a Redis restart), what A wrote meanwhile is
    announced from the values."""
    prefix = f"resync-{secrets.token_hex(4)}:"

    def tier() -> RedisTier:
        return RedisTier(redis_server.url, 64 * CHUNK, key_prefix=prefix, timeout_s=2.0)

    with node(tmp_path, "b", tier()) as (cache_b, events_b, sub_b):
        with node(tmp_path, "a", tier()) as (cache_a, _, _):
            hashes, tokens = store_chain(cache_a, 3, 2)
        sub_b.drain(300)
        assert storage(sub_b.events(), "REMOTE") == []  # nothing heard
        (redis_b,) = cache_b.tiers[1:]
        redis_b.generation += 1  # what a Redis restart looks like to the tier
        cache_b.lookup(NS.namespace_id, hashes)  # a call that answers starts the resync
        got = storage(sub_b.wait_for(lambda ev: len(storage(ev, "REMOTE")) == 2), "REMOTE")
        check_chain(got, hashes, tokens)


def test_after_a_redis_outage_the_resync_announces_what_was_written_meanwhile(
    redis_factory: Callable[..., RedisProc], tmp_path: Path
) -> None:
    """B's Redis goes down (B marks it down), comes back empty on the same port, A (no
    channel between them) writes to it; B's resync announces A's chunks from the values.
    B has no maintenance thread, so its Redis is probed (and resynced) only after A's
    writes, when B's lookups find it skipped."""
    proc = redis_factory()
    prefix = f"outage-{secrets.token_hex(4)}:"

    def tier() -> RedisTier:
        return RedisTier(proc.url, 64 * CHUNK, key_prefix=prefix, timeout_s=1.0)

    with node(tmp_path, "b", tier(), start=False) as (cache_b, _, sub_b):
        proc.stop()
        cache_b.lookup(NS.namespace_id, [b"\1" * 32])  # fails: B marks its Redis down
        assert cache_b.metrics.breaker_trips.labels(tier="redis")._value.get() == 1
        redis_factory(port=proc.port)
        with node(tmp_path, "a", tier()) as (cache_a, _, _):
            hashes, tokens = store_chain(cache_a, 4, 2)

        def announced() -> bool:
            cache_b.lookup(NS.namespace_id, hashes)  # once the backoff is over: the probe
            sub_b.drain()
            return len(storage(sub_b.events(), "REMOTE")) == 2

        wait_until(announced, 30, "B announced A's chunks after its Redis came back")
        check_chain(storage(sub_b.events(), "REMOTE"), hashes, tokens)
        assert cache_b.metrics.resyncs.labels(tier="redis")._value.get() >= 1

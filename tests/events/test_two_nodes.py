"""Two nodes, one Redis Cluster: what node A writes to Redis is announced by node B as
``STORAGE``/``REMOTE`` (the Redis announce channel), is a hit for B with A's bytes, and a
Redis node killed mid-run never makes B serve wrong bytes."""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis
from redis.cluster import RedisCluster

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.values import TierPolicy
from lmcache_svc.config import load_config
from lmcache_svc.keys import chunk_hashes, make_chunk_key
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.events.format import BlockRemoved, BlockStored
from lmcache_svc.server.events.metrics import EventMetrics
from lmcache_svc.server.events.node_stream import NodeEvents, block_hashes
from lmcache_svc.server.events.redis_channel import RedisChannel
from lmcache_svc.server.events.settings import EventsSettings
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.cpu import CpuTier
from lmcache_svc.tiers.redis import RedisTier
from lmcache_svc_bench.redis_procs import (
    RedisClusterProcs,
    RedisProc,
    redis_server_path,
    start_redis_cluster,
)
from tests.events.streams import Subscriber
from tests.helpers import make_chunk, make_layout, make_namespace, wait_until

NS = make_namespace(chunk_size=16, layout=make_layout(block_size=16))
CHUNK = NS.chunk_bytes


@dataclass
class Node:
    cache: TieredCache
    events: NodeEvents
    sub: Subscriber

    def close(self) -> None:
        self.sub.close()
        self.cache.close()
        self.events.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    if redis_server_path() is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server is not on PATH (CI's set-up installs it)")
    procs = start_redis_cluster(tmp_path_factory.mktemp("two-nodes-cluster"))
    yield procs
    procs.stop()


def make_node(name: str, url: str, prefix: str, tmp: Path) -> Node:
    config = load_config(
        env={},
        overrides={"redis.url": url, "redis.cluster": True, "redis.key_prefix": prefix},
    )
    settings = EventsSettings(
        enabled=True, endpoint=f"ipc://{tmp}/{name}-pub", replay_endpoint=None, node=name
    )
    metrics = Metrics()
    events = NodeEvents(settings, EventMetrics(metrics.registry))
    redis = RedisTier(url, 64 * CHUNK, cluster=True, key_prefix=prefix, timeout_s=1.0)
    policy = TierPolicy(write_through=True, backoff_s=0.2, max_backoff_s=0.5)
    arena = Arena.create(16 * CHUNK, slab_bytes=CHUNK, prefault="off")
    cache = TieredCache(CpuTier(arena), [(redis, policy)], metrics=metrics, listener=events)
    events.attach_channel(RedisChannel.for_config(config, redis, events))
    cache.start()
    cache.register_namespace(NS)
    sub = Subscriber(events.publisher.endpoint)
    sub.drain(200)
    return Node(cache, events, sub)


def num_subscribers(cluster: RedisClusterProcs, channel: bytes) -> int:
    """Subscribers of ``channel`` over every node of ``cluster`` (PUBSUB NUMSUB)."""
    total = 0
    for node in cluster.nodes:
        with redis.Redis.from_url(node.url) as client:
            total += sum(int(n) for _, n in client.pubsub_numsub(channel))
    return total


@pytest.fixture
def nodes(cluster: RedisClusterProcs, tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    prefix = f"two-nodes-{secrets.token_hex(4)}:"
    a = make_node("a", cluster.url, prefix, tmp_path)
    b = make_node("b", cluster.url, prefix, tmp_path)
    # Redis pub/sub keeps no backlog: wait for both nodes' channel subscriptions
    wait_until(
        lambda: num_subscribers(cluster, f"{prefix}events".encode()) == 2,
        30,
        "both nodes subscribed to the announce channel",
    )
    yield a, b
    a.close()
    b.close()


def store_chain(node: Node, seed: int, num_chunks: int) -> tuple[list[bytes], np.ndarray]:
    tokens = np.random.default_rng(seed).integers(0, 30_000, num_chunks * NS.chunk_size)
    hashes = chunk_hashes(NS, tokens)
    for i, h in enumerate(hashes):
        part = tokens[i * NS.chunk_size : (i + 1) * NS.chunk_size].astype("<u4").tobytes()
        node.cache.put(
            NS.namespace_id, h, make_chunk(h.hex(), CHUNK),
            token_ids=part, parent_hash=hashes[i - 1] if i else b"",
        )  # fmt: skip
    node.cache.flush()  # the write-through copies are in Redis
    return hashes, tokens


def node_holding(cluster: RedisClusterProcs, node: Node, chunk_hash: bytes) -> RedisProc:
    """The cluster node whose slots hold the chunk's Redis key."""
    (tier,) = node.cache.tiers[1:]
    assert isinstance(tier, RedisTier)
    rkey = tier._rkey(make_chunk_key(NS.namespace_id, chunk_hash))
    with RedisCluster.from_url(cluster.url) as client:
        port = client.get_node_from_key(rkey).port
    return next(p for p in cluster.nodes if p.port == port)


def remote(events: list, kind: type) -> list:
    return [
        e for e in events
        if isinstance(e, kind) and e.medium == "STORAGE" and e.locality == "REMOTE"
    ]  # fmt: skip


def test_a_write_by_one_node_is_announced_and_loadable_on_the_other(nodes) -> None:
    a, b = nodes
    hashes, tokens = store_chain(a, 1, 3)
    got = b.sub.wait_for(lambda ev: len(remote(ev, BlockStored)) == 3)
    stored = remote(got, BlockStored)
    assert [e.block_hashes for e in stored] == [block_hashes(h, 1) for h in hashes]
    assert [e.token_ids for e in stored] == [list(c) for c in tokens.reshape(3, -1).tolist()]
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]
    for h in hashes:  # B loads A's bytes through Redis
        assert b.cache.get(NS.namespace_id, h) == (make_chunk(h.hex(), CHUNK), "redis")
    a.cache.delete(NS.namespace_id, hashes[2:])
    got = b.sub.wait_for(lambda ev: len(remote(ev, BlockRemoved)) == 1)
    assert remote(got, BlockRemoved)[0].block_hashes == block_hashes(hashes[2], 1)


def test_a_redis_node_killed_mid_run_never_serves_wrong_bytes(nodes, cluster) -> None:
    a, b = nodes
    chains = [store_chain(a, 100 + i, 2)[0] for i in range(8)]
    b.sub.wait_for(lambda ev: len(remote(ev, BlockStored)) == 16)
    victim = node_holding(cluster, b, chains[3][0])
    num_hits = num_misses = 0
    for i, chain in enumerate(chains):
        if i == 3:
            victim.stop()  # mid-run: later loads find a third of the slots gone
        for h in chain:
            found = b.cache.get(NS.namespace_id, h)
            if found is None:
                num_misses += 1  # the engine recomputes
            else:
                assert found[0] == make_chunk(h.hex(), CHUNK)
                num_hits += 1
    assert num_hits > 0 and num_misses > 0
    # B stops announcing what it can no longer load from Redis
    got = b.sub.wait_for(lambda ev: len(remote(ev, BlockRemoved)) > 0)
    removed = {h for e in remote(got, BlockRemoved) for h in e.block_hashes}
    assert removed

"""The node-level stream from a cache in this process: what each tier change announces."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.values import TierPolicy
from lmcache_svc.errors import InvalidArgument
from lmcache_svc.keys import Namespace, chunk_hashes
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.events.format import AllBlocksCleared, BlockRemoved, BlockStored
from lmcache_svc.server.events.metrics import EventMetrics
from lmcache_svc.server.events.node_stream import NodeEvents, block_hashes
from lmcache_svc.server.events.settings import EventsSettings
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.cpu import CpuTier
from lmcache_svc.tiers.ssd import SsdTier
from tests.events.streams import Subscriber, replay, request
from tests.events.test_overflow import StalledSend
from tests.helpers import make_chunk, make_layout, make_namespace, wait_until

CHUNK_TOKENS = 32  # two 16-token blocks per chunk
NS = make_namespace(chunk_size=CHUNK_TOKENS, layout=make_layout(block_size=16))
CHUNK = NS.chunk_bytes
TOPIC = b"kv@node:n1@m"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[TieredCache, NodeEvents, Subscriber]]:
    settings = EventsSettings(
        enabled=True,
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        node="n1",
    )
    metrics = Metrics()
    events = NodeEvents(settings, EventMetrics(metrics.registry))
    arena = Arena.create(4 * CHUNK, slab_bytes=CHUNK, prefault="off")
    ssd = SsdTier(tmp_path / "ssd", 64 * (CHUNK + 4096))
    cache = TieredCache(CpuTier(arena), [(ssd, TierPolicy())], metrics=metrics, listener=events)
    sub = Subscriber(events.publisher.endpoint)
    sub.drain(200)  # the connection is up before anything is published
    cache.register_namespace(NS)
    yield cache, events, sub
    sub.close()
    cache.close()
    events.close()


def tokens_of(seed: int, num_chunks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, num_chunks * CHUNK_TOKENS)


def store(cache: TieredCache, tokens: np.ndarray, ns: Namespace = NS) -> list[bytes]:
    """Store every chunk of ``tokens`` inline, described by its tokens and parent."""
    hashes = chunk_hashes(ns, tokens)
    size = ns.chunk_size
    for i, h in enumerate(hashes):
        part = tokens[i * size : (i + 1) * size].astype("<u4").tobytes()
        parent = hashes[i - 1] if i else b""
        cache.put(
            ns.namespace_id, h, make_chunk(h.hex(), ns.chunk_bytes), token_ids=part,
            parent_hash=parent,
        )  # fmt: skip
    return hashes


def stored(events: list, medium: str) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored) and e.medium == medium]


def test_a_store_announces_blocks_with_tokens_and_parents(node) -> None:
    cache, _, sub = node
    tokens = tokens_of(1, 2)
    hashes = store(cache, tokens)
    events = sub.wait_for(lambda ev: len(stored(ev, "CPU")) == 2)
    assert isinstance(events[0], AllBlocksCleared)  # the topic's first use
    first, second = stored(events, "CPU")
    assert first.block_hashes == block_hashes(hashes[0], 2)
    assert first.parent_block_hash is None
    assert first.token_ids == tokens[:CHUNK_TOKENS].tolist()
    assert first.block_size == 16 and first.locality == "LOCAL"
    assert second.parent_block_hash == first.block_hashes[-1]
    assert second.token_ids == tokens[CHUNK_TOKENS:].tolist()
    assert all(r.topic == TOPIC for r in sub.got)
    seqs = [r.seq for r in sub.got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_eviction_moves_the_announcement_to_storage_and_delete_removes_it(node) -> None:
    cache, _, sub = node
    first = store(cache, tokens_of(2, 1))
    store(cache, tokens_of(3, 4))  # four more chunks: the first is evicted to the SSD
    events = sub.wait_for(
        lambda ev: (
            any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in ev)
            and stored(ev, "STORAGE")
        )
    )
    removed = next(e for e in events if isinstance(e, BlockRemoved))
    assert removed.block_hashes == block_hashes(first[0], 2)
    assert stored(events, "STORAGE")[0].block_hashes == block_hashes(first[0], 2)
    assert events.index(removed) > events.index(stored(events, "CPU")[0])
    cache.delete(NS.namespace_id, first)
    events = sub.wait_for(
        lambda ev: any(isinstance(e, BlockRemoved) and e.medium == "STORAGE" for e in ev)
    )


def test_tokens_that_do_not_hash_to_the_chunk_are_refused(node) -> None:
    cache, _, _ = node
    tokens = tokens_of(4, 1)
    (h,) = chunk_hashes(NS, tokens)
    wrong = (tokens + 1).astype("<u4").tobytes()
    with pytest.raises(InvalidArgument, match="do not hash to it"):
        cache.put(NS.namespace_id, h, make_chunk(1, CHUNK), token_ids=wrong)
    assert cache.contains(NS.namespace_id, h) is None


def test_a_chunk_stored_without_tokens_is_not_announced(node) -> None:
    cache, _, sub = node
    (h,) = chunk_hashes(NS, tokens_of(5, 1))
    cache.put(NS.namespace_id, h, make_chunk(2, CHUNK))
    store(cache, tokens_of(6, 1))
    events = sub.wait_for(lambda ev: len(stored(ev, "CPU")) == 1)
    assert stored(events, "CPU")[0].token_ids == tokens_of(6, 1).tolist()


def test_replay_and_snapshot(node) -> None:
    cache, events, sub = node
    hashes = store(cache, tokens_of(7, 3))
    sub.wait_for(lambda ev: len(stored(ev, "CPU")) == 3)
    replayed = replay(events.publisher.replay_endpoint, 0)
    assert [(r.seq, r.batch.events) for r in replayed] == [(r.seq, r.batch.events) for r in sub.got]
    got, epoch = request(events.publisher.replay_endpoint, b"snapshot:" + TOPIC)
    snap = [e for r in got for e in r.batch.events]
    assert [e.block_hashes for e in snap] == [block_hashes(h, 2) for h in hashes]
    assert {r.seq for r in got} == {sub.got[-1].seq}
    assert epoch[:16] == events.publisher.epoch


def test_a_subscriber_that_never_reads_loses_only_what_the_replay_covers(tmp_path: Path) -> None:
    settings = EventsSettings(
        enabled=True,
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        node="n1",
        hwm=4,  # a subscriber more than 4 messages behind loses messages
    )
    metrics = Metrics()
    events = NodeEvents(settings, EventMetrics(metrics.registry))
    big = make_namespace(chunk_size=4096, layout=make_layout(block_size=16))  # 16 KiB events
    arena = Arena.create(48 * big.chunk_bytes, slab_bytes=big.chunk_bytes, prefault="off")
    cache = TieredCache(CpuTier(arena), metrics=metrics, listener=events)
    stuck = Subscriber(events.publisher.endpoint)
    stuck.sock.setsockopt(zmq.RCVHWM, 4)
    stuck.drain(200)
    try:
        cache.register_namespace(big)

        last: list[Any] = []  # the replay of everything, as of the latest look

        def published(num: int) -> bool:
            last[:] = replay(settings.replay_endpoint, 0)
            return len(stored([e for r in last for e in r.batch.events], "CPU")) == num

        for seed in range(40):  # forty batches while one subscriber reads nothing
            store(cache, np.random.default_rng(seed).integers(0, 50_000, 4096), big)
            # this store is numbered and sent: the next one is another batch
            wait_until(partial(published, seed + 1), 20, f"store {seed} published")
        got = stuck.drain(200)
        seqs = [r.seq for r in got]
        assert last[-1].seq >= max(seqs)
        first = last[0].seq
        missed = sorted(set(range(first, last[-1].seq + 1)) - set(seqs))
        assert missed, "the stuck subscriber should have lost messages at its high-water mark"
        recovered = {r.seq: r for r in replay(settings.replay_endpoint, missed[0])}
        view = [e for s in range(first, last[-1].seq + 1) for e in (
            recovered[s] if s in recovered else next(r for r in got if r.seq == s)
        ).batch.events]  # fmt: skip
        assert len(stored(view, "CPU")) == 40
    finally:
        stuck.close()
        cache.close()
        events.close()


def test_a_subscriber_that_connects_late_still_hears_a_restart_while_nothing_is_held(
    node,
) -> None:
    cache, events, early = node
    early.wait_for(lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev))
    late = Subscriber(events.publisher.endpoint)  # e.g. a router reconnecting after a restart
    try:
        late.wait_for(lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev))
        store(cache, tokens_of(9, 1))
        early.wait_for(lambda ev: len(stored(ev, "CPU")) == 1)
        clears = sum(isinstance(e, AllBlocksCleared) for e in early.events())
        third = Subscriber(events.publisher.endpoint)  # something is held now: no clear
        try:
            third.drain(300)
            store(cache, tokens_of(10, 1))
            early.wait_for(lambda ev: len(stored(ev, "CPU")) == 2)
            assert sum(isinstance(e, AllBlocksCleared) for e in early.events()) == clears
        finally:
            third.close()
    finally:
        late.close()


def test_a_restarted_publisher_numbers_on_above_the_old_one() -> None:
    from lmcache_svc.server.events.publisher import EventLog

    old = EventLog(buffer_steps=8, max_pending=8, resync=dict)
    old.add(b"t", [AllBlocksCleared()])
    last = old.flush()  # one batch: numbered with the start-up time itself
    assert EventLog(buffer_steps=8, max_pending=8, resync=dict).next_seq > last


def test_a_snapshot_covers_changes_the_publisher_has_not_applied_yet(node) -> None:
    cache, events, sub = node
    stall = StalledSend(events.publisher)
    first = store(cache, tokens_of(8, 1))
    assert stall.entered.wait(10)  # the publisher is stuck sending; nothing applies the next
    second = store(cache, tokens_of(9, 1))
    # The second store's change at least is not applied (one of the first's may not be
    # either: on a loaded host its records can miss the batch the publisher is stuck on).
    assert len(events._log.changes) >= 1
    got, _ = request(events.publisher.replay_endpoint, b"snapshot:" + TOPIC)
    snap = [e for r in got for e in r.batch.events]
    assert sorted(e.block_hashes for e in snap) == sorted(
        block_hashes(h, 2) for h in first + second
    )
    stall.release.set()
    events_seen = sub.wait_for(lambda ev: len(stored(ev, "CPU")) == 2)
    assert [e.block_hashes for e in stored(events_seen, "CPU")] == [
        block_hashes(h, 2) for h in first + second
    ]

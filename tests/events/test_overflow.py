"""The publisher's queue overflowing (a consumer slower than the stores): the events are
dropped and counted, and the stream goes on with one ``AllBlocksCleared`` and a full
re-announcement per topic, built once when the publisher catches up, so a subscriber's view
ends exactly as the tiers are (a removal dropped with the queue is not a block a router
still believes in) and the sequence has no gap."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lmcache_svc.cache import TieredCache
from lmcache_svc.keys import chunk_hashes
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.events import publisher as publisher_module
from lmcache_svc.server.events.format import AllBlocksCleared, BlockRemoved, BlockStored
from lmcache_svc.server.events.metrics import EventMetrics
from lmcache_svc.server.events.node_stream import NodeEvents, block_hashes
from lmcache_svc.server.events.publisher import ZmqPublisher, _Batch
from lmcache_svc.server.events.settings import EventsSettings
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.cpu import CpuTier
from tests.events.streams import Received, Subscriber
from tests.helpers import make_chunk, make_layout, make_namespace

NS = make_namespace(chunk_size=16, layout=make_layout(block_size=16))
CHUNK = NS.chunk_bytes
MAX_PENDING = 4


class StalledSend:
    """Stands in for the publisher's send: the first batch it gets waits until
    ``release`` (the publisher thread is stuck there, as behind a slow consumer), later
    ones go straight through."""

    def __init__(self, publisher: ZmqPublisher) -> None:
        self._send = publisher._send
        self.entered = threading.Event()
        self.release = threading.Event()
        publisher._send = self  # type: ignore[method-assign]

    def __call__(self, batches: list[_Batch]) -> None:
        if not self.release.is_set():
            self.entered.set()
            assert self.release.wait(30), "the test never released the publisher"
        self._send(batches)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[TieredCache, NodeEvents, Subscriber]]:
    settings = EventsSettings(
        enabled=True,
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=None,
        node="n1",
        max_pending=MAX_PENDING,
    )
    events = NodeEvents(settings, EventMetrics(Metrics().registry))
    arena = Arena.create(32 * CHUNK, slab_bytes=CHUNK, prefault="off")
    cache = TieredCache(CpuTier(arena), listener=events)
    sub = Subscriber(events.publisher.endpoint)
    sub.drain(200)  # the connection is up before anything is published
    cache.register_namespace(NS)
    sub.wait_for(lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev))
    yield cache, events, sub
    sub.close()
    cache.close()
    events.close()


def store(cache: TieredCache, seed: int) -> bytes:
    tokens = np.random.default_rng(seed).integers(0, 30_000, NS.chunk_size)
    (h,) = chunk_hashes(NS, tokens)
    cache.put(
        NS.namespace_id, h, make_chunk(h.hex(), CHUNK), token_ids=tokens.astype("<u4").tobytes()
    )
    return h


def view_of(got: list[Received]) -> set[int]:
    """The CPU blocks a subscriber believes in, from the stream alone."""
    view: set[int] = set()
    for r in got:
        for e in r.batch.events:
            if isinstance(e, BlockStored):
                view.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                view.difference_update(e.block_hashes)
            else:
                view.clear()
    return view


def test_an_overflow_is_counted_and_resynced_once(node) -> None:
    cache, events, sub = node
    stall = StalledSend(events.publisher)
    first = store(cache, 0)  # numbered, then the publisher stalls sending it
    assert stall.entered.wait(10)
    later = [store(cache, seed) for seed in range(1, 4 * MAX_PENDING)]
    cache.delete(NS.namespace_id, [first])  # a removal queued behind the overflow
    stall.release.set()

    expected = {b for h in later for b in block_hashes(h, 1)}
    sub.wait_for(lambda _: view_of(sub.got) == expected)
    assert events.metrics.resyncs._value.get() == 1
    assert events.metrics.dropped_events._value.get() >= len(later) - MAX_PENDING
    seqs = [r.seq for r in sub.got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # nothing numbered was lost
    # after the first chunk's store: one clear, then every chunk held, once
    after = [e for r in sub.got[2:] for e in r.batch.events]
    assert isinstance(after[0], AllBlocksCleared)
    assert sorted(b for e in after[1:] for b in e.block_hashes) == sorted(expected)


def test_the_stream_goes_on_normally_after_a_resync(node) -> None:
    cache, events, sub = node
    stall = StalledSend(events.publisher)
    store(cache, 0)
    assert stall.entered.wait(10)
    kept = [store(cache, seed) for seed in range(1, 2 * MAX_PENDING)]
    stall.release.set()
    expected = {b for h in kept for b in block_hashes(h, 1)} | set(block_hashes(store(cache, 0), 1))
    sub.wait_for(lambda _: view_of(sub.got) == expected)
    cache.delete(NS.namespace_id, kept[:2])
    expected -= {b for h in kept[:2] for b in block_hashes(h, 1)}
    sub.wait_for(lambda _: view_of(sub.got) == expected)
    assert events.metrics.resyncs._value.get() == 1


def test_a_behind_publisher_keeps_the_record_backlog_bounded(node) -> None:
    cache, events, sub = node
    stall = StalledSend(events.publisher)
    store(cache, 0)
    assert stall.entered.wait(10)
    backlog = []
    for seed in range(1, 6 * MAX_PENDING):
        store(cache, seed)
        backlog.append(len(events._log.changes))
    assert max(backlog) <= MAX_PENDING  # each store past the bound applied two records
    stall.release.set()
    sub.wait_for(lambda _: events.metrics.resyncs._value.get() == 1)


def test_a_store_does_not_wait_for_the_stream_while_its_publisher_is_busy(node) -> None:
    """The store path only records the change: with the publisher busy (not waiting to be
    woken) a store completes while another thread holds the stream's lock, and the chunk is
    announced once the publisher goes on."""
    cache, events, sub = node
    stall = StalledSend(events.publisher)
    store(cache, 0)
    assert stall.entered.wait(10)
    stored_hash: list[bytes] = []
    with events._lock:
        worker = threading.Thread(target=lambda: stored_hash.append(store(cache, 1)))
        worker.start()
        worker.join(10)
        assert not worker.is_alive(), "the store waited for the stream's lock"
    stall.release.set()
    expected = set(block_hashes(stored_hash[0], 1))
    sub.wait_for(lambda _: expected <= view_of(sub.got))


def test_a_backlog_applied_in_slices_announces_every_store_in_order(node, monkeypatch) -> None:
    cache, events, sub = node
    monkeypatch.setattr(publisher_module, "APPLY_SLICE", 1)
    stall = StalledSend(events.publisher)
    first = store(cache, 0)
    assert stall.entered.wait(10)
    later = [store(cache, seed) for seed in range(1, MAX_PENDING)]  # a backlog, no overflow
    assert len(events._log.changes) == len(later)
    stall.release.set()
    expected = [block_hashes(h, 1) for h in [first, *later]]
    sub.wait_for(lambda ev: len([e for e in ev if isinstance(e, BlockStored)]) == len(expected))
    got = [e.block_hashes for r in sub.got for e in r.batch.events if isinstance(e, BlockStored)]
    assert got == expected
    assert events.metrics.resyncs._value.get() == 0

"""Stores, loads, deletes and evictions from several threads at once, then a subscriber's
view (built only from the stream) is reconciled with what the tiers hold: no store or
removal missed, no removal before its store, nothing announced that a load would miss."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.values import TierPolicy
from lmcache_svc.keys import chunk_hashes, make_chunk_key
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.events.format import AllBlocksCleared, BlockRemoved, BlockStored
from lmcache_svc.server.events.metrics import EventMetrics
from lmcache_svc.server.events.node_stream import NodeEvents, block_hashes
from lmcache_svc.server.events.settings import EventsSettings
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.cpu import CpuTier
from lmcache_svc.tiers.ssd import SsdTier
from tests.events.streams import Subscriber
from tests.helpers import make_chunk, make_layout, make_namespace

NS = make_namespace(chunk_size=16, layout=make_layout(block_size=16))
CHUNK = NS.chunk_bytes
NUM_PROMPTS = 120


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[TieredCache, SsdTier, NodeEvents]]:
    settings = EventsSettings(
        enabled=True, endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=None, node="soak"
    )
    metrics = Metrics()
    events = NodeEvents(settings, EventMetrics(metrics.registry))
    arena = Arena.create(8 * CHUNK, slab_bytes=CHUNK, prefault="off")
    ssd = SsdTier(tmp_path / "ssd", 24 * (CHUNK + 4096))
    cache = TieredCache(CpuTier(arena), [(ssd, TierPolicy())], metrics=metrics, listener=events)
    cache.register_namespace(NS)
    yield cache, ssd, events
    cache.close()
    events.close()


def store(cache: TieredCache, seed: int) -> bytes:
    tokens = np.random.default_rng(seed).integers(0, 30_000, NS.chunk_size)
    (h,) = chunk_hashes(NS, tokens)
    data = make_chunk(h.hex(), CHUNK)
    cache.put(NS.namespace_id, h, data, token_ids=tokens.astype("<u4").tobytes())
    return h


def test_a_subscribers_view_matches_the_tiers_after_a_soak(node) -> None:
    cache, ssd, events = node
    sub = Subscriber(events.publisher.endpoint)
    sub.drain(200)
    stored: list[bytes] = []
    lock = threading.Lock()

    def writer(first: int) -> None:
        for seed in range(first, NUM_PROMPTS, 3):
            h = store(cache, seed)
            with lock:
                stored.append(h)

    def churn() -> None:
        rng = random.Random(7)
        for _ in range(NUM_PROMPTS):
            with lock:
                pick = rng.choice(stored) if stored else None
            if pick is None:
                continue
            if rng.random() < 0.8:
                cache.get(NS.namespace_id, pick)  # may promote from the SSD
            else:
                cache.delete(NS.namespace_id, [pick])

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
    threads.append(threading.Thread(target=churn))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cache.flush()

    # the subscriber's view, from the stream alone (every event checked on the way)
    view: dict[str, set[int]] = {"CPU": set(), "STORAGE": set()}

    def apply(new: list) -> None:
        for r in new:
            for e in r.batch.events:
                if isinstance(e, BlockStored):
                    assert not set(e.block_hashes) & view[e.medium], "stored twice"
                    view[e.medium].update(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    assert set(e.block_hashes) <= view[e.medium], "removed before stored"
                    view[e.medium].difference_update(e.block_hashes)
                else:
                    assert isinstance(e, AllBlocksCleared)
                    for held in view.values():
                        held.clear()

    def held() -> dict[str, set[int]]:
        out: dict[str, set[int]] = {"CPU": set(), "STORAGE": set()}
        for h in set(stored):
            (blocks,) = [block_hashes(h, 1)]
            if cache.first_tier_holds(NS.namespace_id, [h]):
                out["CPU"].update(blocks)
            if ssd.contains_many([make_chunk_key(NS.namespace_id, h)])[0]:
                out["STORAGE"].update(blocks)
        return out

    expected = held()
    for _ in range(200):
        apply(sub.drain(100))
        if view == expected:
            break
        expected = held()
    assert view == expected, {
        medium: {
            "announced, not held": view[medium] - held_now,
            "held, not announced": held_now - view[medium],
        }
        for medium, held_now in expected.items()
    }
    assert len(expected["CPU"]) > 0 and len(expected["STORAGE"]) > 0
    assert events.metrics.unannounced.labels(reason="no_parent")._value.get() == 0
    sub.close()

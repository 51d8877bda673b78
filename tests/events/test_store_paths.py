"""Every path that makes a chunk loadable announces it: the inline gRPC ``Put`` and the REST
``PUT`` carry the chunk's token ids and parent as ``CommitStore`` does, and a store through
them is a ``BlockStored`` on the node stream; tokens that do not hash to the chunk are
refused and store nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.client import CacheClient
from lmcache_svc.client.events import ChunkTokens
from lmcache_svc.errors import InvalidArgument
from lmcache_svc.keys import chunk_hashes
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.events.format import BlockStored
from lmcache_svc.server.events.metrics import EventMetrics
from lmcache_svc.server.events.node_stream import NodeEvents, block_hashes
from lmcache_svc.server.events.settings import EventsSettings
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.cpu import CpuTier
from tests.events.streams import Subscriber
from tests.helpers import make_chunk
from tests.server.conftest import serve_http  # noqa: F401 (a fixture)
from tests.server.inprocess import CHUNK, NS, InProcessServer, serve  # noqa: F401
from tests.server.rest import Served

BLOCKS = NS.chunk_size // NS.layout.block_size


@pytest.fixture
def events(tmp_path: Path) -> Iterator[tuple[NodeEvents, Subscriber]]:
    settings = EventsSettings(
        enabled=True,
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        node="n1",
    )
    node = NodeEvents(settings, EventMetrics(Metrics().registry))
    sub = Subscriber(node.publisher.endpoint)
    sub.drain(200)  # the connection is up before anything is published
    yield node, sub
    sub.close()
    node.close()


def prompt(seed: int, num_chunks: int) -> tuple[list[bytes], list[bytes], list[list[int]]]:
    """Chunk hashes, parents and token ids of a random prompt."""
    tokens = np.random.default_rng(seed).integers(0, 50_000, num_chunks * NS.chunk_size)
    hashes = chunk_hashes(NS, tokens)
    parts = [
        tokens[i * NS.chunk_size : (i + 1) * NS.chunk_size].tolist() for i in range(len(hashes))
    ]
    return hashes, [b"", *hashes[:-1]], parts


def stored(events: list) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def check_announced(sub: Subscriber, hashes: list[bytes], tokens: list[list[int]]) -> None:
    got = stored(sub.wait_for(lambda ev: len(stored(ev)) == len(hashes)))
    assert [e.block_hashes for e in got] == [block_hashes(h, BLOCKS) for h in hashes]
    assert [e.token_ids for e in got] == tokens
    assert got[0].parent_block_hash is None
    assert got[1].parent_block_hash == got[0].block_hashes[-1]
    assert all(e.medium == "CPU" for e in got)


def test_an_inline_grpc_put_is_announced(serve, events) -> None:  # noqa: F811
    node, sub = events
    server: InProcessServer = serve(num_chunks=4, listener=node)
    hashes, parents, tokens = prompt(1, 2)
    described = ChunkTokens()
    for h, p, t in zip(hashes, parents, tokens):
        described.add(h, p, np.asarray(t, "<u4").tobytes())
    items = [(h, make_chunk(h.hex(), CHUNK)) for h in hashes]
    with CacheClient(server.socket, timeout_s=30, use_shm=False) as client:
        assert client.put(NS.namespace_id, items, described=described) == 2
        check_announced(sub, hashes, tokens)
        wrong = ChunkTokens()
        other, _, other_tokens = prompt(2, 1)
        wrong.add(other[0], b"", np.asarray(other_tokens[0], "<u4").tobytes()[::-1])
        with pytest.raises(InvalidArgument, match="do not hash to it"):
            client.put(NS.namespace_id, [(other[0], make_chunk(3, CHUNK))], described=wrong)
        assert server.cache.contains(NS.namespace_id, other[0]) is None
        assert server.cache.stats().pending_stores == 0  # the refused upload let its slot go


def test_a_rest_put_is_announced(serve_http, events) -> None:  # noqa: F811
    node, sub = events
    arena = Arena.create(4 * CHUNK, slab_bytes=CHUNK, prefault="off")
    cache = TieredCache(CpuTier(arena), settings=CacheSettings(), listener=node)
    app: Served = serve_http(cache, max_body_bytes=CHUNK)
    ns_hex = app.register(NS)
    hashes, parents, tokens = prompt(3, 2)
    for h, p, t in zip(hashes, parents, tokens):
        headers = {"X-LMCache-Token-Ids": ",".join(map(str, t))}
        if p:
            headers["X-LMCache-Parent-Hash"] = p.hex()
        r = app.client.put(
            app.chunk_url(ns_hex, h), content=make_chunk(h.hex(), CHUNK), headers=headers
        )
        assert r.status_code == 201, r.text
    check_announced(sub, hashes, tokens)


def _ids(last: str) -> str:
    """A chunk's worth of token ids, the last one ``last``."""
    return ",".join(["1"] * (NS.chunk_size - 1) + [last])


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({"X-LMCache-Token-Ids": _ids("x")}, "not a comma-separated list"),
        ({"X-LMCache-Token-Ids": _ids("4294967296")}, "out of"),
        ({"X-LMCache-Parent-Hash": "ab" * 32}, "without X-LMCache-Token-Ids"),
        ({"X-LMCache-Token-Ids": _ids("1"), "X-LMCache-Parent-Hash": "zz"}, "Parent-Hash"),
        ({"X-LMCache-Token-Ids": "1,2"}, f"2 token ids for a chunk of {NS.chunk_size}"),
        ({"X-LMCache-Token-Ids": "1," * 5_000 + "1"}, "5001 token ids for a chunk"),
        ({"X-LMCache-Token-Ids": ",".join(["7"] * NS.chunk_size)}, "do not hash to it"),
    ],
)
def test_a_rest_put_with_bad_tokens_is_refused(
    serve_http: Callable[..., Served],  # noqa: F811
    events,
    headers: dict[str, str],
    message: str,
) -> None:
    node, _ = events
    arena = Arena.create(4 * CHUNK, slab_bytes=CHUNK, prefault="off")
    cache = TieredCache(CpuTier(arena), settings=CacheSettings(), listener=node)
    app = serve_http(cache, max_body_bytes=CHUNK)
    ns_hex = app.register(NS)
    (h,), _, _ = prompt(4, 1)
    r = app.client.put(app.chunk_url(ns_hex, h), content=make_chunk(1, CHUNK), headers=headers)
    assert r.status_code == 400, r.text
    assert message in r.text
    assert cache.contains(NS.namespace_id, h) is None


@pytest.mark.parametrize(
    ("tokens", "parent", "message"),
    [
        (b"\0" * 8, b"", "token_ids holds 8 bytes"),
        (b"", b"\1" * 32, "parent_hash without token_ids"),
        (b"\0" * (4 * NS.chunk_size), b"\1" * 5, "parent_hash is 5 bytes"),
    ],
)
def test_an_inline_put_with_a_malformed_description_is_refused_before_its_bytes(
    serve,  # noqa: F811
    tokens: bytes,
    parent: bytes,
    message: str,
) -> None:
    # No listener (events off): the shape is checked all the same, before a slot is taken.
    server: InProcessServer = serve(num_chunks=4)
    (h,), _, _ = prompt(6, 1)
    described = ChunkTokens()
    described.add(h, parent, tokens)
    with CacheClient(server.socket, timeout_s=30, use_shm=False) as client:
        with pytest.raises(InvalidArgument, match=message):
            client.put(NS.namespace_id, [(h, make_chunk(6, CHUNK))], described=described)
    assert server.cache.contains(NS.namespace_id, h) is None
    assert server.cache.stats().pending_stores == 0

"""A real engine's own event stream, read with vLLM's own classes and by NVIDIA Dynamo's
KV indexer: the sidecar's chunks appear in it next to vLLM's GPU blocks, with the engine's
own block hashes, and leave it when the sidecar drops them or restarts. Dynamo follows the
engine's stream and the node stream with one indexer each: one indexer on both would drop
the engine's copies of chunks that start a prompt (docs/events.md,
``test_dynamo_engine_stream.py``).

One engine, one sidecar and two indexers for the module (an engine takes minutes to start on
this machine): the tests run in order on distinct prompts."""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lmcache_svc.client import CacheClient
from lmcache_svc.client.events import ChunkTokens
from lmcache_svc.keys import chunk_hashes
from lmcache_svc_bench.procs import ServerProc, free_port, start_server
from lmcache_svc_bench.vllm.bench_model import VOCAB_SIZE, make_tiny_model
from lmcache_svc_bench.vllm.engines import EngineProc
from tests.events.dynamo import Indexer, require_dynamo
from tests.events.engines import VllmReader, events_env, of_type, start_engine
from tests.vllm.conftest import require_vllm_venv
from tests.vllm.e2e import tiny_model_namespace

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]
CHUNK = 128  # the plugin's default on the CPU backend: one vLLM block per chunk


@dataclass
class Node:
    tmp: Path
    model_dir: Path
    server: ServerProc
    server_env: dict[str, str]
    engine: EngineProc
    engine_stream: VllmReader
    node_stream: VllmReader
    indexer: Indexer  # the engine's stream: worker 1
    node_indexer: Indexer  # the node stream: worker 2
    old_workdirs: list[Path] = field(default_factory=list)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    require_vllm_venv()
    require_dynamo()
    tmp = tmp_path_factory.mktemp("events-e2e")
    model_dir = make_tiny_model(tmp / "model")
    env = events_env(  # fixed ports: a restarted server binds the same endpoints
        LMCACHE_SVC_EVENTS__ENDPOINT=f"tcp://127.0.0.1:{free_port()}",
        LMCACHE_SVC_EVENTS__REPLAY_ENDPOINT=f"tcp://127.0.0.1:{free_port()}",
    )
    server = start_server(tmp, env=env)
    stop: list[Any] = []
    engine: EngineProc | None = None
    try:
        node_stream = VllmReader.start(server.ready["events"])
        stop.append(node_stream)
        engine, endpoint = start_engine("a", model_dir, tmp, server)
        engine_stream = VllmReader.start(endpoint)
        stop.append(engine_stream)
        indexer = Indexer.start({1: endpoint}, CHUNK, tmp)
        stop.append(indexer)
        node_indexer = Indexer.start({2: server.ready["events"]}, CHUNK, tmp)
        stop.append(node_indexer)
        node = Node(
            tmp, model_dir, server, env, engine, engine_stream, node_stream, indexer, node_indexer
        )
        yield node
        server = node.server
        for workdir in node.old_workdirs:
            shutil.rmtree(workdir, ignore_errors=True)
    finally:
        for item in stop:
            item.stop()
        if engine is not None:
            engine.close()
        server.cleanup()


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]


def stepped(node: Node, events: list[dict], kind: str, medium: str, num_blocks: int) -> bool:
    """Whether the stream has ``num_blocks`` blocks in events of ``kind``; else one short
    request, so that the engine steps: vLLM takes a connector's events only in a step."""
    if sum(len(e["block_hashes"]) for e in of_type(events, kind, medium)) >= num_blocks:
        return True
    node.engine.generate([prompt(99, 8)], 1)
    return False


def test_the_sidecars_chunks_carry_the_engines_own_block_hashes(node: Node) -> None:
    tokens = prompt(1, 4 * CHUNK + 50)
    node.engine.generate([tokens], 4)
    events = node.engine_stream.wait_for(lambda ev: stepped(node, ev, "BlockStored", "CPU", 4))
    cpu = of_type(events, "BlockStored", "CPU")
    gpu_hash_of = {  # vLLM's own events: several blocks per event
        tuple(e["token_ids"][j * CHUNK : (j + 1) * CHUNK]): h
        for e in of_type(events, "BlockStored", "GPU")
        for j, h in enumerate(e["block_hashes"])
    }
    for i, event in enumerate(cpu[:4]):
        block = tokens[i * CHUNK : (i + 1) * CHUNK]
        assert event["token_ids"] == block
        assert event["block_size"] == CHUNK and event["locality"] == "LOCAL"
        assert event["block_hashes"] == [gpu_hash_of[tuple(block)]]
        assert event["parent_block_hash"] == (cpu[i - 1]["block_hashes"][0] if i else None)
        assert event["dp_rank"] == 0
    assert not of_type(events, "undecodable")
    node_events = node.node_stream.wait_for(lambda ev: len(of_type(ev, "BlockStored", "CPU")) >= 4)
    assert not of_type(node_events, "undecodable")
    assert [e["token_ids"] for e in of_type(node_events, "BlockStored", "CPU")[:4]] == [
        e["token_ids"] for e in cpu[:4]
    ]

    # the sidecar drops the chunks: the engine's stream removes exactly those blocks
    namespace = tiny_model_namespace(node.model_dir, chunk_size=CHUNK)
    with CacheClient(node.server.socket, timeout_s=5) as client:
        ns_id = client.register_namespace(namespace)
        assert client.delete(ns_id, chunk_hashes(namespace, tokens)) == 4
    events = node.engine_stream.wait_for(lambda ev: stepped(node, ev, "BlockRemoved", "CPU", 4))
    removed = [h for e in of_type(events, "BlockRemoved", "CPU") for h in e["block_hashes"]]
    assert sorted(removed) == sorted(e["block_hashes"][0] for e in cpu[:4])


def poll(node: Node, check: Any, what: str, timeout_s: float = 60, node_tokens: Any = ()) -> None:
    """Until ``check()`` holds, stepping the engine (its connector's events are taken in
    steps) between tries."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            seen = node.engine_stream.drain()
            cpu = [
                (e["type"], e.get("seq"), e.get("medium"), e.get("block_hashes", [])[:2])
                for e in seen
            ][-12:]
            raise AssertionError(
                f"{what}: not reached in {timeout_s} s; the engine's last events {cpu}; "
                f"{node.indexer.query(list(node_tokens))}; {node.indexer.log()}"
            )
        node.engine.generate([prompt(98, 8)], 1)
        time.sleep(0.2)


def store_as_another_engine(node: Node, tokens: list[int]) -> list[bytes]:
    """Store the prompt's full chunks in the sidecar (described by their tokens) as another
    engine of the node would; engine A never computed them."""
    namespace = tiny_model_namespace(node.model_dir, chunk_size=CHUNK)
    hashes = chunk_hashes(namespace, tokens)
    described = ChunkTokens()
    for i, h in enumerate(hashes):
        part = np.asarray(tokens[i * CHUNK : (i + 1) * CHUNK], dtype="<u4").tobytes()
        described.add(h, hashes[i - 1] if i else b"", part)
    with CacheClient(node.server.socket, timeout_s=5) as client:
        ns_id = client.register_namespace(namespace)
        slots = client.prepare_store(ns_id, hashes)
        assert all(s.status == "reserved" for s in slots)
        assert client.commit_store(ns_id, hashes, described=described) == len(hashes)
    return hashes


def test_the_engine_announces_chunks_other_engines_stored(node: Node) -> None:
    tokens = prompt(4, 3 * CHUNK + 10)
    store_as_another_engine(node, tokens)
    blocks = [tokens[i * CHUNK : (i + 1) * CHUNK] for i in range(3)]

    def announced(events: list[dict]) -> bool:
        mine = [e for e in of_type(events, "BlockStored", "CPU") if e["token_ids"] in blocks]
        if len(mine) == 3:
            return True
        node.engine.generate([prompt(97, 8)], 1)  # a step: vLLM takes the events
        return False

    events = node.engine_stream.wait_for(announced)
    mine = [e for e in of_type(events, "BlockStored", "CPU") if e["token_ids"] in blocks]
    assert [e["token_ids"] for e in mine] == blocks
    assert mine[0]["parent_block_hash"] is None
    assert [e["parent_block_hash"] for e in mine[1:]] == [e["block_hashes"][0] for e in mine[:2]]


def test_dynamo_scores_the_engine_and_the_node_for_the_sidecars_tiers(node: Node) -> None:
    """Dynamo's indexers on the engine's stream (worker 1) and on the node stream (worker 2)."""
    idx, node_idx = node.indexer, node.node_indexer
    computed = prompt(3, 2 * CHUNK + 10)
    node.engine.generate([computed], 2)  # vLLM's own blocks, and the sidecar's
    poll(node, lambda: idx.matched(computed, 1, "gpu") == 2 * CHUNK, "the engine's GPU blocks")
    poll(node, lambda: node_idx.matched(computed, 2, "cpu") == 2 * CHUNK, "the node's CPU blocks")

    tokens = prompt(2, 4 * CHUNK + 30)
    hashes = store_as_another_engine(node, tokens)
    full = 4 * CHUNK
    poll(
        node,
        lambda: idx.matched(tokens, 1, "cpu") == full,
        "the engine's CPU blocks",
        node_tokens=tokens,
    )
    poll(node, lambda: node_idx.matched(tokens, 2, "cpu") == full, "another engine's chunks")
    assert idx.matched(tokens, 1, "gpu") == 0  # only the sidecar holds them

    # the sidecar drops the last two chunks: the CPU match shrinks to two blocks
    namespace = tiny_model_namespace(node.model_dir, chunk_size=CHUNK)
    with CacheClient(node.server.socket, timeout_s=5) as client:
        ns_id = client.register_namespace(namespace)
        assert client.delete(ns_id, hashes[2:]) == 2
    poll(
        node,
        lambda: idx.matched(tokens, 1, "cpu") == 2 * CHUNK,
        "the engine's removal",
        node_tokens=tokens,
    )
    poll(node, lambda: node_idx.matched(tokens, 2, "cpu") == 2 * CHUNK, "the node's removal")

    # a sidecar restart: nothing of it is left in either stream, vLLM's own blocks stay
    old = node.server
    old.stop()  # SIGTERM: the socket and the segment go, the socket's directory stays
    node.server = start_server(node.tmp, env=node.server_env, socket_path=old.socket)
    node.old_workdirs.append(old.workdir)
    poll(
        node, lambda: idx.matched(tokens, 1, "cpu") == 0, "the engine's restart", node_tokens=tokens
    )
    poll(node, lambda: node_idx.matched(tokens, 2, "cpu") == 0, "the node's restart")
    assert idx.matched(computed, 1, "gpu") == 2 * CHUNK

    # and the engine's own stream removes every block it announced from the old sidecar
    def all_removed(events: list[dict]) -> bool:
        cpu = {h for e in of_type(events, "BlockStored", "CPU") for h in e["block_hashes"]}
        gone = {h for e in of_type(events, "BlockRemoved", "CPU") for h in e["block_hashes"]}
        if cpu and gone == cpu:
            return True
        node.engine.generate([prompt(96, 8)], 1)
        return False

    node.engine_stream.wait_for(all_removed)

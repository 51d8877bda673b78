"""NVIDIA Dynamo's indexer on an engine's stream, without an engine: a stand-in
(``engine_stand_in.py``) publishes through vLLM's own publisher what a real engine's stream
carries (vLLM's GPU events and, in the same batches, the plugin's relay of a real sidecar's
tiers), stepping only when told, as vLLM takes a connector's events only in a step.

Following engine streams only, Dynamo scores the sidecar's blocks for the engine: on their
own, continuing the engine's GPU prefix, shrinking when the sidecar drops chunks and staying
when vLLM evicts its GPU copies. One indexer that follows a node stream and an engine stream
of the same sidecar does not score the engine's copies: Dynamo keeps one block hash per
(parent, tokens) across all workers of its CPU and disk tiers and ignores a second one
(docs/events.md, "Pointing routers at it"); that test pins the behaviour of the version
``scripts/setup_dynamo.sh`` installs."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lmcache_svc.client import CacheClient
from lmcache_svc.client.events import ChunkTokens
from lmcache_svc.keys import ChunkHash, chunk_hashes
from lmcache_svc_bench.procs import ServerProc, free_port
from lmcache_svc_bench.vllm.engines import VLLM_PYTHON
from tests.events.dynamo import Indexer, require_dynamo
from tests.events.engine_stand_in import BLOCK, CHUNK, namespace
from tests.events.engines import start_events_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@dataclass
class Engine:
    """The stand-in process and the indexer that follows its stream alone."""

    proc: subprocess.Popen[str]
    endpoint: str
    server: ServerProc
    indexer: Indexer

    def command(self, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the stand-in exited ({self.proc.wait()})")
        return dict(json.loads(line))

    def step(self) -> list[list[Any]]:
        return list(self.command(step=True)["published"])

    def poll(self, check: Callable[[], bool], what: str, index: Indexer | None = None) -> None:
        """Until ``check()`` holds, stepping between tries."""
        deadline = time.monotonic() + 30
        while not check():
            if time.monotonic() > deadline:
                idx = index or self.indexer
                raise AssertionError(f"{what}: not reached in 30 s; {idx.log()}")
            self.step()
            time.sleep(0.1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} is missing: run scripts/setup_vllm.sh first (CI does)")
    require_dynamo()
    tmp = tmp_path_factory.mktemp("dynamo-engine-stream")
    server = start_events_server(tmp)
    port = free_port()
    python_path = os.pathsep.join([str(REPO), str(REPO / "connectors" / "vllm")])
    proc = subprocess.Popen(
        [str(VLLM_PYTHON), str(HERE / "engine_stand_in.py"), server.socket, f"tcp://*:{port}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp / "stand-in.log", "w"),  # noqa: SIM115
        text=True, env={**os.environ, "PYTHONPATH": python_path},
    )  # fmt: skip
    indexer: Indexer | None = None
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        assert ready, f"the stand-in did not start: {(tmp / 'stand-in.log').read_text()[-3000:]}"
        endpoint = f"tcp://127.0.0.1:{port}"
        indexer = Indexer.start({1: endpoint}, BLOCK, tmp)
        rig = Engine(proc, endpoint, server, indexer)
        warm = prompt(0, BLOCK)
        rig.poll(  # ZMQ drops what is published before the indexer's subscription is up
            lambda: rig.command(gpu=warm) == {} and indexer.matched(warm, 1, "gpu") == BLOCK,
            "the indexer's subscription",
        )
        yield rig
    finally:
        if indexer is not None:
            indexer.stop()
        proc.kill()
        proc.wait()
        server.cleanup()


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 30000) for _ in range(length)]


def store(server: ServerProc, tokens: list[int]) -> list[ChunkHash]:
    """The prompt's full chunks into the sidecar, described by their tokens (as another
    engine's save would)."""
    ns = namespace()
    hashes = chunk_hashes(ns, tokens)
    described = ChunkTokens()
    for i, h in enumerate(hashes):
        part = np.asarray(tokens[i * CHUNK : (i + 1) * CHUNK], dtype="<u4").tobytes()
        described.add(h, hashes[i - 1] if i else b"", part)
    with CacheClient(server.socket, timeout_s=5) as client:
        ns_id = client.register_namespace(ns)
        assert all(s.status == "reserved" for s in client.prepare_store(ns_id, hashes))
        assert client.commit_store(ns_id, hashes, described=described) == len(hashes)
    return hashes


def delete(server: ServerProc, hashes: list[ChunkHash]) -> None:
    with CacheClient(server.socket, timeout_s=5) as client:
        assert client.delete(client.register_namespace(namespace()), hashes) == len(hashes)


def test_dynamo_scores_the_sidecars_blocks_on_the_engines_stream(engine: Engine) -> None:
    idx = engine.indexer

    def scored(tokens: list[int], gpu: int, cpu: int) -> Callable[[], bool]:
        return lambda: (idx.matched(tokens, 1, "gpu"), idx.matched(tokens, 1, "cpu")) == (gpu, cpu)

    # vLLM holds the first two chunks on the GPU, the sidecar all four: CPU continues GPU
    computed = prompt(1, 4 * CHUNK + 5)
    engine.command(gpu=computed[: 2 * CHUNK])
    store(engine.server, computed)
    engine.poll(scored(computed, 2 * CHUNK, 4 * CHUNK), "the GPU prefix, then the sidecar's")

    # chunks only the sidecar holds (another engine computed them)
    other = prompt(2, 3 * CHUNK)
    hashes = store(engine.server, other)
    engine.poll(scored(other, 0, 3 * CHUNK), "the sidecar's chunks alone")

    # the sidecar drops the last chunk: the match shrinks
    delete(engine.server, hashes[2:])
    engine.poll(scored(other, 0, 2 * CHUNK), "the sidecar's removal")

    # vLLM evicts its GPU copies: the sidecar's stay the engine's
    engine.command(gpu_removed=computed[: 2 * CHUNK])
    engine.poll(scored(computed, 0, 4 * CHUNK), "vLLM's eviction")


def test_one_indexer_on_both_streams_ignores_the_engines_first_blocks(
    engine: Engine, tmp_path: Path
) -> None:
    """Pins Dynamo 1.6.1: the node stream announces a chunk first, under the server's block
    hashes; the engine's relay of it, under the engine's, is ignored by an indexer that
    follows both where the two name the same edge, a prompt's first block (the engine-only
    indexer scores it); CPU blocks that continue the engine's GPU blocks are scored."""
    node = engine.server.ready["events"]
    shared = Indexer.start({1: engine.endpoint, 2: node}, BLOCK, tmp_path)
    try:
        warm: list[list[int]] = []

        def node_heard() -> bool:  # what the server publishes before the subscription is lost
            warm.append(prompt(100 + len(warm), CHUNK))
            store(engine.server, warm[-1])
            time.sleep(0.2)
            return any(shared.matched(w, 2, "cpu") == CHUNK for w in warm)

        engine.poll(node_heard, "the node stream", shared)

        # a prompt the engine's GPU does not hold: its first block's edge is the node's
        alone = prompt(11, 2 * CHUNK)
        # a prompt whose first chunk vLLM holds: the engine's CPU blocks continue its GPU
        # blocks, under edges whose parents only the engine names
        continued = prompt(12, 2 * CHUNK)
        engine.command(gpu=continued[:CHUNK])  # published at the next step
        for tokens in (alone, continued):
            store(engine.server, tokens)  # the node stream has it now, the engine's later
        deadline = time.monotonic() + 30
        while any(shared.matched(t, 2, "cpu") != 2 * CHUNK for t in (alone, continued)):
            assert time.monotonic() < deadline, shared.log()
            time.sleep(0.1)

        def relayed() -> bool:
            return all(engine.indexer.matched(t, 1, "cpu") == 2 * CHUNK for t in (alone, continued))

        engine.poll(relayed, "the relay")
        for _ in range(10):  # the shared indexer read the same batch
            assert shared.matched(alone, 1, "cpu") == 0
            assert shared.matched(alone, 2, "cpu") == 2 * CHUNK
            assert shared.matched(continued, 1, "gpu") == CHUNK
            assert shared.matched(continued, 1, "cpu") == 2 * CHUNK
            time.sleep(0.1)
    finally:
        shared.stop()

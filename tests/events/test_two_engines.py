"""Two nodes, each a real vLLM engine with its own sidecar, sharing one 3-node Redis
Cluster: a prompt engine A computed is a hit for engine B through Redis, with A's output;
B's own event stream shows those blocks as ``STORAGE``/``REMOTE`` before B ever saw the
prompt; with the Redis node that holds a prompt's chunk killed, B recomputes and still gives
A's output (never wrong bytes).

Prompts are drawn with wide greedy margins on A (``tests/vllm/e2e.py``: a near-tied token
could flip on the last bf16 bits of a cached-prefix prefill), so B's output must equal A's
token for token."""

from __future__ import annotations

import random
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis.cluster import RedisCluster

from lmcache_svc.client import CacheClient
from lmcache_svc.keys import chunk_hashes, make_chunk_key
from lmcache_svc_bench.procs import ServerProc, start_server
from lmcache_svc_bench.redis_procs import (
    RedisClusterProcs,
    RedisProc,
    redis_server_path,
    start_redis_cluster,
)
from lmcache_svc_bench.vllm.bench_model import VOCAB_SIZE, make_tiny_model
from lmcache_svc_bench.vllm.engines import EngineProc
from lmcache_svc_bench.workload_serve import scrape
from tests.events.engines import VllmReader, events_env, of_type, start_engine
from tests.helpers import wait_until
from tests.vllm.conftest import require_vllm_venv
from tests.vllm.e2e import MAX_DRAWS, MAX_TOKENS, MIN_MARGIN, tiny_model_namespace

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
CHUNK = 128  # the plugin's default on the CPU backend: one vLLM block per chunk
PROMPT_LEN = 4 * CHUNK + 20  # four full chunks and a tail
LOOKUP_TIMEOUT_MS = 1000
SIDECAR_SERIES = ("lmcache_svc_lookup", "lmcache_svc_tier_breaker", "lmcache_svc_tier_errors")


@dataclass
class Pair:
    model_dir: Path
    cluster: RedisClusterProcs
    key_prefix: str
    servers: list[ServerProc]
    a: EngineProc
    b: EngineProc
    b_stream: VllmReader


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    require_vllm_venv()
    if redis_server_path() is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server is not on PATH (CI's set-up installs it)")
    tmp = tmp_path_factory.mktemp("two-engines")
    model_dir = make_tiny_model(tmp / "model")
    cluster = start_redis_cluster(tmp / "cluster")
    prefix = f"two-engines-{secrets.token_hex(4)}:"
    servers: list[ServerProc] = []
    engines: list[EngineProc] = []
    stream: VllmReader | None = None
    try:
        for name in ("a", "b"):
            (tmp / name).mkdir()
            env = events_env(LMCACHE_SVC_EVENTS__NODE=name, LMCACHE_SVC_REDIS__KEY_PREFIX=prefix)
            servers.append(
                start_server(tmp / name, "--redis-url", cluster.url, "--redis-cluster", env=env)
            )
        a, _ = start_engine("a", model_dir, tmp / "a", servers[0])
        engines.append(a)
        # B's lookups go to Redis Cluster: a deadline of 1 s, not the default 0.1 s, so a
        # loaded 2-core CI host (two engines, two sidecars, three Redis nodes) does not
        # turn the hit this module checks into a miss by the lookup's deadline
        b, b_endpoint = start_engine(
            "b", model_dir, tmp / "b", servers[1], lookup_timeout_ms=LOOKUP_TIMEOUT_MS
        )
        engines.append(b)
        stream = VllmReader.start(b_endpoint)
        yield Pair(model_dir, cluster, prefix, servers, a, b, stream)
    finally:
        if stream is not None:
            stream.stop()
        for engine in engines:
            engine.close()
        for server in servers:
            server.cleanup()
        cluster.stop()


def wide_margin_prompt(engine: EngineProc, seed: int) -> tuple[list[int], list[int]]:
    """A prompt whose greedy tokens on ``engine`` (computed in full) are no near-ties, and
    those tokens."""
    for draw in range(MAX_DRAWS):
        rng = random.Random(seed + 1000 * draw)
        prompt = [rng.randrange(3, VOCAB_SIZE) for _ in range(PROMPT_LEN)]
        (out,) = engine.generate([prompt], MAX_TOKENS, margins=True)
        if out["num_cached_tokens"] == 0 and min(out["margins"]) >= MIN_MARGIN:
            return prompt, list(out["token_ids"])
    raise AssertionError(f"no prompt with margins >= {MIN_MARGIN} in {MAX_DRAWS} draws")


def hashes_of(pair: Pair, prompt: list[int]) -> list[bytes]:
    return chunk_hashes(tiny_model_namespace(pair.model_dir, chunk_size=CHUNK), prompt)


def wait_held_by_b(pair: Pair, prompt: list[int]) -> None:
    """A's write-through reached Redis: B's sidecar finds every full chunk (in Redis)."""
    namespace = tiny_model_namespace(pair.model_dir, chunk_size=CHUNK)
    with CacheClient(pair.servers[1].socket, timeout_s=5) as client:
        ns_id = client.register_namespace(namespace)
        hashes = chunk_hashes(namespace, prompt)
        wait_until(
            lambda: client.lookup(ns_id, hashes).num_hit_chunks == len(hashes),
            60,
            "A's chunks found by B's sidecar",
        )


def node_holding(pair: Pair, chunk_hash: bytes) -> RedisProc:
    """The cluster node whose slots hold the chunk's Redis key (``RedisTier``'s naming:
    the key prefix, then the chunk key in hex)."""
    namespace = tiny_model_namespace(pair.model_dir, chunk_size=CHUNK)
    rkey = (
        pair.key_prefix.encode() + make_chunk_key(namespace.namespace_id, chunk_hash).hex().encode()
    )
    with RedisCluster.from_url(pair.cluster.url) as client:
        port = client.get_node_from_key(rkey).port
    return next(p for p in pair.cluster.nodes if p.port == port)


def why_not_a_hit(pair: Pair) -> str:
    """What B's plugin and sidecar say about lookups and Redis, for a failed hit's message."""
    plugin = {k: v for k, v in pair.b.metrics().items() if "lookup" in k or "load" in k}
    sidecar = scrape(pair.servers[1].http_url.rstrip("/") + "/metrics")
    server = [
        (name, labels, v) for name, labels, v in sidecar.samples if name.startswith(SIDECAR_SERIES)
    ]
    return (
        f"B's plugin: {plugin}\nB's sidecar: {server}\n"
        f"its log: {pair.servers[1].log()[-3000:]}\nB's engine log: {pair.b.log_tail(3000)}"
    )


def test_a_prompt_engine_a_computed_is_a_remote_hit_for_engine_b(pair: Pair) -> None:
    prompt, expected = wide_margin_prompt(pair.a, seed=1)
    wait_held_by_b(pair, prompt)
    blocks = [prompt[i * CHUNK : (i + 1) * CHUNK] for i in range(4)]

    def announced(events: list[dict]) -> bool:
        mine = [
            e for e in of_type(events, "BlockStored", "STORAGE")
            if e["token_ids"] in blocks and e["locality"] == "REMOTE"
        ]  # fmt: skip
        if len(mine) >= 4:
            return True
        pair.b.generate([[5, 6, 7, 8]], 1)  # a step: vLLM takes the connector's events
        return False

    # B's own stream shows A's chunks in the shared tier before B computed anything of them
    events = pair.b_stream.wait_for(announced, 90)
    remote = [e for e in of_type(events, "BlockStored", "STORAGE") if e["token_ids"] in blocks]
    assert sorted(blocks.index(e["token_ids"]) for e in remote[:4]) == [0, 1, 2, 3]
    assert all(e["block_size"] == CHUNK for e in remote)

    (out,) = pair.b.generate([prompt], MAX_TOKENS)
    # every full chunk, from Redis through B
    assert out["num_cached_tokens"] == 4 * CHUNK, why_not_a_hit(pair)
    assert out["token_ids"] == expected


def test_with_a_redis_node_killed_b_recomputes_and_gives_as_output(pair: Pair) -> None:
    prompts = [wide_margin_prompt(pair.a, seed=100 + i) for i in range(3)]
    for prompt, _ in prompts:
        wait_held_by_b(pair, prompt)
    victim = node_holding(pair, hashes_of(pair, prompts[0][0])[0])
    victim.stop()  # the first chunk of the first prompt is gone with it
    served = []
    for prompt, expected in prompts:
        (out,) = pair.b.generate([prompt], MAX_TOKENS)
        assert out["token_ids"] == expected  # recomputed or loaded, never wrong bytes
        served.append(out["num_cached_tokens"])
    assert served[0] == 0, "B served a prefix whose first chunk died with its Redis node"

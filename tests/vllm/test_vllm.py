"""End-to-end: real vLLM engines (CPU) with the plugin, next to a real lmcache-svc server.

Engines run in their own processes (``harness.EngineProc``) and are shared by the tests of
this module to keep it within a few minutes on two cores: ``ref`` (no plugin: the expected
outputs), ``a`` (stores), ``b`` (a fresh process that loads; its connector class adds only
the server-kill hook of ``fault_connector.py``), and short-lived engines for isolation.
Each test uses its own prompts and empties vLLM's local prefix cache where it matters, so
every hit counted below came from the server.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lmcache_svc.bench.procs import ServerProc, start_server
from lmcache_svc.bench.vllm.bench_model import (
    HEAD_SIZE,
    NUM_KV_HEADS,
    VOCAB_SIZE,
    make_tiny_model,
)
from lmcache_svc.bench.vllm.engines import EngineProc, delta, kv_transfer_config
from lmcache_svc.client import CacheClient
from lmcache_svc.keys import KVLayout, Namespace, chunk_hashes
from tests.vllm.conftest import require_vllm_venv

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

CHUNK = 256
BLOCK = 128
PROMPT_LEN = 700  # two full chunks + a tail: the chunk-aligned hit is 512 tokens
MAX_TOKENS = 16
EXT_HITS = "vllm:external_prefix_cache_hits"
EXT_SOURCE = "vllm:prompt_tokens_by_source{source=external_kv_transfer}"


def make_prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]


P_CROSS = make_prompt(1)
P_BASE = make_prompt(2)
P_SHARED = P_BASE[:384] + make_prompt(3, PROMPT_LEN - 384)  # 1.5 chunks in common
P_DONOR, P_CORRUPT = make_prompt(4), make_prompt(5)
P_ISOLATED = make_prompt(6)
P_FAULT_BETWEEN, P_FAULT_LOAD, P_AFTER_RESTART = make_prompt(7), make_prompt(8), make_prompt(9)
P_ASYNC, P_ASYNC_FAULT = make_prompt(10), make_prompt(11)
ALL_PROMPTS = [
    P_CROSS, P_BASE, P_SHARED, P_DONOR, P_CORRUPT, P_ISOLATED,
    P_FAULT_BETWEEN, P_FAULT_LOAD, P_AFTER_RESTART, P_ASYNC, P_ASYNC_FAULT,
]  # fmt: skip


@dataclass
class Env:
    tmp: Path
    model_dir: Path
    server: ServerProc
    ref: dict[tuple[int, ...], list[int]]
    a: EngineProc
    b: EngineProc
    kill_file: Path

    def expected(self, prompt: list[int]) -> list[int]:
        return self.ref[tuple(prompt)]

    def plugin_config(self, **extra: Any) -> dict[str, Any]:
        return kv_transfer_config(self.server.socket, retry_interval_s=0.2, **extra)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_vllm_venv()
    tmp = tmp_path_factory.mktemp("vllm-e2e")
    model_dir = make_tiny_model(tmp / "model")
    server = start_server(tmp)
    engines: list[EngineProc] = []
    try:
        ref_engine = EngineProc.start("ref", model_dir, tmp)
        engines.append(ref_engine)
        ref = {tuple(p): _generate_alone(ref_engine, p) for p in ALL_PROMPTS}
        ref_engine.close()
        kill_file = tmp / "kill-server.pid"
        config = kv_transfer_config(server.socket, retry_interval_s=0.2)
        a = EngineProc.start("a", model_dir, tmp, kv_config=config)
        engines.append(a)
        b_config = {**config, "kv_connector": "FaultInjectingConnector"}
        b_config["kv_connector_module_path"] = "fault_connector"
        b = EngineProc.start(
            "b",
            model_dir,
            tmp,
            kv_config=b_config,
            env={"LMCACHE_SVC_TEST_KILL_FILE": str(kill_file)},
            python_path=[HERE],
        )
        engines.append(b)
        holder = Env(tmp, model_dir, server, ref, a, b, kill_file)
        yield holder
        server = holder.server
    finally:
        for engine in engines:
            engine.close()
        server.cleanup()


def _generate_alone(engine: EngineProc, prompt: list[int]) -> list[int]:
    engine.reset_prefix_cache()
    return list(engine.generate([prompt], MAX_TOKENS)[0]["token_ids"])


def _run(engine: EngineProc, prompt: list[int]) -> dict[str, object]:
    return engine.generate([prompt], MAX_TOKENS)[0]


def test_fresh_engine_loads_prefix_from_sidecar(env: Env) -> None:
    stored = _run(env.a, P_CROSS)
    assert stored["num_cached_tokens"] == 0
    assert stored["token_ids"] == env.expected(P_CROSS)

    before = env.b.metrics()
    loaded = _run(env.b, P_CROSS)
    after = env.b.metrics()

    assert loaded["num_cached_tokens"] == 512
    assert loaded["token_ids"] == env.expected(P_CROSS)
    assert delta(after, before, EXT_HITS) == 512
    assert delta(after, before, EXT_SOURCE) == 512
    assert delta(after, before, "vllm:lmcache_svc_load_chunks") == 2
    assert delta(after, before, "vllm:lmcache_svc_load_bytes") == 2 * 512 * 1024
    assert delta(after, before, "vllm:lmcache_svc_load_failed_blocks") == 0


def test_only_shared_chunks_hit(env: Env) -> None:
    _run(env.a, P_BASE)
    env.b.reset_prefix_cache()
    before = env.b.metrics()
    shared = _run(env.b, P_SHARED)
    after = env.b.metrics()
    # 384 tokens in common = one full chunk + half of the next: only the full one matches.
    assert shared["num_cached_tokens"] == CHUNK
    assert delta(after, before, EXT_HITS) == CHUNK
    assert shared["token_ids"] == env.expected(P_SHARED)


def test_output_depends_on_loaded_kv(env: Env) -> None:
    """Control: chunks holding the wrong KV change the output, so equal outputs above
    really mean the loaded KV was right (and this test's namespace is the engine's)."""
    _run(env.a, P_DONOR)
    namespace = tiny_model_namespace(env.model_dir)
    with CacheClient(env.server.socket, timeout_s=5) as client:
        ns_id = client.register_namespace(namespace)
        donor = client.load(ns_id, chunk_hashes(namespace, P_DONOR))
        assert len(donor) == 2, "engine a did not store the donor prompt's chunks"
        assert client.store(ns_id, chunk_hashes(namespace, P_CORRUPT), donor) == 2
    env.b.reset_prefix_cache()
    corrupt = _run(env.b, P_CORRUPT)
    assert corrupt["num_cached_tokens"] == 512
    assert corrupt["token_ids"] != env.expected(P_CORRUPT)


def tiny_model_namespace(model_dir: Path, tenant: str = "default") -> Namespace:
    layout = KVLayout(
        dtype="bfloat16",
        num_layers=4,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        block_size=BLOCK,
        page_layout="vllm-cpu/BHNC",
    )
    return Namespace(model=str(model_dir), layout=layout, chunk_size=CHUNK, tenant=tenant)


@pytest.mark.parametrize("differs", ["tenant", "model"])
def test_tenants_and_models_are_isolated(env: Env, differs: str) -> None:
    _run(env.a, P_ISOLATED)
    if differs == "tenant":
        model_dir, config = env.model_dir, env.plugin_config(tenant="other-tenant")
    else:  # the same weights under another model path: still another model
        model_dir, config = make_tiny_model(env.tmp / "model-copy"), env.plugin_config()
    other = EngineProc.start(f"other-{differs}", model_dir, env.tmp, kv_config=config)
    try:
        result = _run(other, P_ISOLATED)
        metrics = other.metrics()
    finally:
        other.close()
    assert result["num_cached_tokens"] == 0
    assert metrics.get(EXT_HITS, 0) == 0
    assert metrics["vllm:lmcache_svc_lookups"] >= 1  # it did ask, and the server said no
    assert metrics["vllm:lmcache_svc_lookup_failures"] == 0
    assert result["token_ids"] == env.expected(P_ISOLATED)


def test_async_load_path(env: Env) -> None:
    """load_mode=async: the request waits for a background load; a SIGKILL during it is
    reported as failed blocks and recomputed. On a private server (it gets killed)."""
    server = start_server(env.tmp)
    kill_file = env.tmp / "kill-async.pid"
    config = kv_transfer_config(
        server.socket,
        connector="FaultInjectingConnector",
        module="fault_connector",
        load_mode="async",
        retry_interval_s=0.2,
    )
    engine = EngineProc.start(
        "async",
        env.model_dir,
        env.tmp,
        kv_config=config,
        env={"LMCACHE_SVC_TEST_KILL_FILE": str(kill_file)},
        python_path=[HERE],
    )
    try:
        for prompt in (P_ASYNC, P_ASYNC_FAULT):
            assert _run(engine, prompt)["token_ids"] == env.expected(prompt)
        engine.reset_prefix_cache()
        before = engine.metrics()
        loaded = _run(engine, P_ASYNC)
        middle = engine.metrics()
        assert loaded["num_cached_tokens"] == 512
        assert delta(middle, before, EXT_HITS) == 512
        assert loaded["token_ids"] == env.expected(P_ASYNC)

        kill_file.write_text(str(server.proc.pid))
        failed = _run(engine, P_ASYNC_FAULT)
        after = engine.metrics()
        assert kill_file.with_suffix(".done").exists(), "the load never started"
        assert delta(after, middle, "vllm:lmcache_svc_load_failed_blocks") == 4
        assert failed["token_ids"] == env.expected(P_ASYNC_FAULT)
    finally:
        engine.close()
        server.cleanup()


def test_server_faults_never_fail_requests(env: Env) -> None:
    for prompt in (P_FAULT_LOAD, P_FAULT_BETWEEN):
        assert _run(env.a, prompt)["num_cached_tokens"] == 0  # a stores both
        _wait_stored(env, prompt)

    # SIGKILL mid-load: the scheduler has promised vLLM a hit; the worker kills the server
    # right before leasing the chunks. vLLM must recompute the blocks.
    env.b.reset_prefix_cache()
    before = env.b.metrics()
    env.kill_file.write_text(str(env.server.proc.pid))
    mid_load = _run(env.b, P_FAULT_LOAD)
    after = env.b.metrics()
    assert env.kill_file.with_suffix(".done").exists(), "the load never started"
    env.server.kill()
    assert mid_load["token_ids"] == env.expected(P_FAULT_LOAD)
    assert delta(after, before, "vllm:lmcache_svc_load_failed_blocks") == 4

    # Killed between a's store and b's request: a miss, computed from scratch, quickly.
    start = time.monotonic()
    between = _run(env.b, P_FAULT_BETWEEN)
    assert time.monotonic() - start < 10
    assert between["num_cached_tokens"] == 0
    assert between["token_ids"] == env.expected(P_FAULT_BETWEEN)

    # Back on the same socket: both engines reconnect by themselves and hit again.
    env.server = start_server(env.tmp, socket_path=env.server.socket)
    assert _hits_again(env, P_AFTER_RESTART, deadline_s=30)


def _wait_stored(env: Env, prompt: list[int], timeout_s: float = 10) -> None:
    """Saves are committed in the background: wait until the server has the chunks."""
    namespace = tiny_model_namespace(env.model_dir)
    with CacheClient(env.server.socket, timeout_s=5) as client:
        ns_id = client.register_namespace(namespace)
        deadline = time.monotonic() + timeout_s
        while client.lookup(ns_id, chunk_hashes(namespace, prompt)).num_hit_chunks < 2:
            assert time.monotonic() < deadline, "chunks were not committed in time"
            time.sleep(0.05)


def _hits_again(env: Env, prompt: list[int], deadline_s: float) -> bool:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        env.a.reset_prefix_cache()
        assert _run(env.a, prompt)["token_ids"] == env.expected(prompt)
        env.b.reset_prefix_cache()
        result = _run(env.b, prompt)
        assert result["token_ids"] == env.expected(prompt)
        if result["num_cached_tokens"] == 512:
            return True
        time.sleep(0.2)
    return False

"""End-to-end: real vLLM engines (CPU) with the plugin, next to a real lmcache-svc server.

Engines run in their own processes (``EngineProc``) and are shared by the end-to-end tests
(the session fixture ``env`` in ``conftest.py``, built by ``e2e.start_env``) to keep them
within a few minutes on two cores: ``ref`` (no plugin: the expected outputs, on prompts
whose greedy tokens are no near-ties, see ``e2e.py``), ``a`` (stores), ``b`` (a fresh
process that loads; its connector class adds only the server-signal hook of
``fault_connector.py``), and short-lived engines for isolation. Each test uses its own
prompts and empties vLLM's local prefix cache where it matters, so every hit counted below
came from the server.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lmcache_svc.client import CacheClient
from lmcache_svc.keys import chunk_hashes
from lmcache_svc_bench.procs import start_server
from lmcache_svc_bench.vllm.bench_model import make_tiny_model
from lmcache_svc_bench.vllm.engines import EngineProc, delta, kv_transfer_config
from tests.vllm.e2e import (
    BLOCK,
    CHUNK,
    DEFAULT_CHUNK,
    EXT_HITS,
    EXT_SOURCE,
    HERE,
    Env,
    hits_again,
    make_prompt,
    run,
    tiny_model_namespace,
    wait_stored,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


def test_fresh_engine_loads_prefix_from_sidecar(env: Env) -> None:
    stored = run(env.a, env.prompt("cross"))
    assert stored["num_cached_tokens"] == 0
    assert stored["token_ids"] == env.expected(env.prompt("cross"))
    wait_stored(env, [env.prompt("cross")])

    before = env.b.metrics()
    loaded = run(env.b, env.prompt("cross"))
    after = env.b.metrics()

    assert loaded["num_cached_tokens"] == 512
    assert loaded["token_ids"] == env.expected(env.prompt("cross"))
    assert delta(after, before, EXT_HITS) == 512
    assert delta(after, before, EXT_SOURCE) == 512
    assert delta(after, before, "vllm:lmcache_svc_load_chunks") == 2
    assert delta(after, before, "vllm:lmcache_svc_load_bytes") == 2 * 512 * 1024
    assert delta(after, before, "vllm:lmcache_svc_load_failed_blocks") == 0
    # The hook accounting reaches Prometheus (vLLM's in-process metrics reader truncates
    # counters to ints, so the seconds counters read 0 here; the call count does not).
    assert delta(after, before, "vllm:lmcache_svc_hook_calls") > 0


def test_a_hits_stats_ride_the_next_step_not_its_first_tokens(env: Env) -> None:
    """The step that computes a hit's first token hands vLLM none of the plugin's stats
    (vLLM records them before that token reaches the caller); the next step hands them
    over. A one-token hit is a single step: its load is counted once another request runs,
    while vLLM's own counters of that step are there at once."""
    hit, other = make_prompt(9_101), make_prompt(9_102)
    run(env.a, hit)
    wait_stored(env, [hit])
    env.b.reset_prefix_cache()
    before = env.b.metrics()
    assert env.b.generate([hit], 1)[0]["num_cached_tokens"] == 512
    middle = env.b.metrics()
    env.b.generate([other], 1)
    after = env.b.metrics()
    assert delta(middle, before, EXT_HITS) == 512  # vLLM's own, in the hit's step
    assert delta(middle, before, "vllm:lmcache_svc_load_chunks") == 0  # held back
    assert delta(middle, before, "vllm:lmcache_svc_lookups") == 0
    # The hit's load and lookup are counted by now (the other request's own lookup may
    # still be held: a miss asked of the server may take a step of its own).
    assert delta(after, before, "vllm:lmcache_svc_load_chunks") == 2
    assert delta(after, before, "vllm:lmcache_svc_lookups") >= 1


def test_default_chunk_hit_covers_what_vllm_own_cache_covers(env: Env) -> None:
    """With no chunk settings the chunk is derived from the engine's block size (on the CPU
    backend the block itself), so a sidecar hit serves as many tokens as vLLM's own prefix
    cache: for a 700-token prompt, 5 whole 128-token blocks."""
    prompt = env.prompt("default_chunk")
    config = kv_transfer_config(env.server.socket, retry_interval_s=0.2)  # no chunk_size
    engine = EngineProc.start("default-chunk", env.model_dir, env.tmp, kv_config=config)
    try:
        computed = run(engine, prompt)
        own_cache = run(engine, prompt)  # vLLM's own prefix-cache hit
        wait_stored(env, [prompt], chunk_size=DEFAULT_CHUNK)
        engine.reset_prefix_cache()  # so the next hit can only come from the sidecar
        before = engine.metrics()
        loaded = run(engine, prompt)
        after = engine.metrics()
    finally:
        engine.close()
    assert DEFAULT_CHUNK == BLOCK
    assert computed["num_cached_tokens"] == 0
    assert own_cache["num_cached_tokens"] == (len(prompt) - 1) // BLOCK * BLOCK == 640
    assert loaded["num_cached_tokens"] == own_cache["num_cached_tokens"]
    assert delta(after, before, EXT_HITS) == 640
    assert delta(after, before, "vllm:lmcache_svc_load_chunks") == 640 // DEFAULT_CHUNK
    assert loaded["token_ids"] == own_cache["token_ids"] == env.expected(prompt)


def test_only_shared_chunks_hit(env: Env) -> None:
    run(env.a, env.prompt("base"))
    wait_stored(env, [env.prompt("base")])
    env.b.reset_prefix_cache()
    before = env.b.metrics()
    shared = run(env.b, env.prompt("shared"))
    after = env.b.metrics()
    # 384 tokens in common = one full chunk + half of the next: only the full one matches.
    assert shared["num_cached_tokens"] == CHUNK
    assert delta(after, before, EXT_HITS) == CHUNK
    assert shared["token_ids"] == env.expected(env.prompt("shared"))


def test_output_depends_on_loaded_kv(env: Env) -> None:
    """Control: chunks holding the wrong KV change the output, so equal outputs above
    really mean the loaded KV was right (and this test's namespace is the engine's)."""
    run(env.a, env.prompt("donor"))
    wait_stored(env, [env.prompt("donor")])
    namespace = tiny_model_namespace(env.model_dir)
    with CacheClient(env.server.socket, timeout_s=5) as client:
        ns_id = client.register_namespace(namespace)
        donor = client.load(ns_id, chunk_hashes(namespace, env.prompt("donor")))
        assert len(donor) == 2, "engine a did not store the donor prompt's chunks"
        assert client.store(ns_id, chunk_hashes(namespace, env.prompt("corrupt")), donor) == 2
    env.b.reset_prefix_cache()
    corrupt = run(env.b, env.prompt("corrupt"))
    assert corrupt["num_cached_tokens"] == 512
    assert corrupt["token_ids"] != env.expected(env.prompt("corrupt"))


@pytest.mark.parametrize("differs", ["tenant", "model"])
def test_tenants_and_models_are_isolated(env: Env, differs: str) -> None:
    run(env.a, env.prompt("isolated"))
    wait_stored(env, [env.prompt("isolated")])  # so a miss below means isolation
    if differs == "tenant":
        model_dir, config = env.model_dir, env.plugin_config(tenant="other-tenant")
    else:  # the same weights under another model path: still another model
        model_dir, config = make_tiny_model(env.tmp / "model-copy"), env.plugin_config()
    other = EngineProc.start(f"other-{differs}", model_dir, env.tmp, kv_config=config)
    try:
        result = run(other, env.prompt("isolated"))
        metrics = other.metrics()
    finally:
        other.close()
    assert result["num_cached_tokens"] == 0
    assert metrics.get(EXT_HITS, 0) == 0
    assert metrics["vllm:lmcache_svc_lookups"] >= 1  # it did ask, and the server said no
    assert metrics["vllm:lmcache_svc_lookup_failures"] == 0
    assert result["token_ids"] == env.expected(env.prompt("isolated"))


def test_a_load_copied_beside_the_forward_pass_is_waited_for_layer_by_layer(env: Env) -> None:
    """``overlap_loads`` (the default): b's copy thread sleeps 0.3 s before each of the 4
    layers' copies (``fault_connector.py``), so the forward pass reaches every layer before
    its KV is in place. vLLM must wait for each one: the output is the reference's (a wrong
    KV changes it: ``test_output_depends_on_loaded_kv``)."""
    prompt = env.prompt("slow_copy")
    assert run(env.a, prompt)["num_cached_tokens"] == 0
    wait_stored(env, [prompt])
    env.b.reset_prefix_cache()
    before = env.b.metrics()
    env.slow_copy_file.write_text("0.3")
    try:
        loaded = run(env.b, prompt)
    finally:
        env.slow_copy_file.unlink()
    delayed = Path(f"{env.slow_copy_file}.layers").read_text().split()
    after = env.b.metrics()
    assert loaded["num_cached_tokens"] == 512
    assert delta(after, before, "vllm:lmcache_svc_load_in_place_chunks") == 2
    assert delta(after, before, "vllm:lmcache_svc_load_failed_blocks") == 0
    assert delayed == ["0", "1", "2", "3"]  # every layer went by the (slowed) copy thread
    assert loaded["token_ids"] == env.expected(prompt)


def test_steps_without_work_at_the_layers_skip_the_per_layer_hooks(env: Env) -> None:
    """vLLM calls ``wait_for_layer_load`` and ``save_kv_layer`` at an attention layer only
    when ``has_connector_metadata`` says so, and the plugin says so only while its worker
    has work there (a load still copying): a miss's decode steps make a handful of hook
    calls each, not two more for each of the model's 4 layers."""
    before = env.b.metrics()
    env.b.generate([make_prompt(9_201)], 40)
    env.b.generate([make_prompt(9_202)], 4)  # its stats carry the first one's out
    after = env.b.metrics()
    calls = delta(after, before, "vllm:lmcache_svc_hook_calls")
    steps = 40 + 4
    assert 0 < calls < 12 * steps  # 396 (9 a step) in a run; 740 with the per-layer hooks


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
        chunk_size=CHUNK,
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
        for prompt in (env.prompt("async"), env.prompt("async_fault")):
            assert run(engine, prompt)["token_ids"] == env.expected(prompt)
        wait_stored(env, [env.prompt("async"), env.prompt("async_fault")], server=server)
        engine.reset_prefix_cache()
        before = engine.metrics()
        loaded = run(engine, env.prompt("async"))
        middle = engine.metrics()
        assert loaded["num_cached_tokens"] == 512
        assert delta(middle, before, EXT_HITS) == 512
        assert loaded["token_ids"] == env.expected(env.prompt("async"))

        kill_file.write_text(str(server.proc.pid))
        failed = run(engine, env.prompt("async_fault"))
        after = engine.metrics()
        assert kill_file.with_suffix(".done").exists(), "the load never started"
        assert delta(after, middle, "vllm:lmcache_svc_load_failed_blocks") == 4
        assert failed["token_ids"] == env.expected(env.prompt("async_fault"))
    finally:
        engine.close()
        server.cleanup()


def test_server_faults_never_fail_requests(env: Env) -> None:
    for prompt in (env.prompt("fault_load"), env.prompt("fault_between")):
        assert run(env.a, prompt)["num_cached_tokens"] == 0  # a stores both
        wait_stored(env, [prompt])

    # SIGKILL mid-load: the scheduler has promised vLLM a hit; the worker kills the server
    # right before leasing the chunks. vLLM must recompute the blocks.
    env.b.reset_prefix_cache()
    before = env.b.metrics()
    env.kill_file.with_suffix(".done").unlink(missing_ok=True)
    env.kill_file.write_text(str(env.server.proc.pid))
    mid_load = run(env.b, env.prompt("fault_load"))
    after = env.b.metrics()
    assert env.kill_file.with_suffix(".done").exists(), "the load never started"
    env.server.kill()
    assert mid_load["token_ids"] == env.expected(env.prompt("fault_load"))
    assert delta(after, before, "vllm:lmcache_svc_load_failed_blocks") == 4

    # Killed between a's store and b's request: a miss, computed from scratch, quickly.
    start = time.monotonic()
    between = run(env.b, env.prompt("fault_between"))
    assert time.monotonic() - start < 10
    assert between["num_cached_tokens"] == 0
    assert between["token_ids"] == env.expected(env.prompt("fault_between"))

    # Back on the same socket: both engines reconnect by themselves and hit again.
    env.server = start_server(env.tmp, socket_path=env.server.socket)
    assert hits_again(env, [env.prompt("after_restart")], deadline_s=30)

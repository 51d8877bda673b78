"""build_vllm_kv_cache on real vLLM: messages run through one engine with the connector land
in the service; a fresh engine's request that starts with them loads that prefix from the
service, and its greedy output equals that of an engine without the connector whose own
prefix cache holds the same prefix (the same computation: the prefix computed alone, then
the rest over it; a one-pass prefill rounds differently in bf16 and can flip a near-tied
token of this random-weight model, REFERENCE section 6)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_svc.kv_memory import KVCacheMemory
from lmcache_svc.kv_memory.tiny_model import SPECIALS, sample_text, word_tokenizer
from lmcache_svc_bench.procs import start_server
from lmcache_svc_bench.vllm.bench_model import VOCAB_SIZE, make_tiny_model
from lmcache_svc_bench.vllm.engines import EngineProc, delta, kv_transfer_config
from tests.kv_memory.conftest import memos_config
from tests.vllm.conftest import require_vllm_venv

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

CHUNK = 128  # the plugin's default chunk on the CPU backend: vLLM's 128-token block
EXT_HITS = "vllm:external_prefix_cache_hits"
NUM_WORDS = VOCAB_SIZE - len(SPECIALS)
# Every compared engine computes on one thread (an engine with a connector reserves one more
# core than one without, and other reductions flip near-tied greedy tokens).
ONE_THREAD = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def test_build_vllm_kv_cache_makes_a_later_request_hit_the_service(tmp_path: Path) -> None:
    require_vllm_venv()
    model_dir = make_tiny_model(tmp_path / "model")  # vLLM-friendly random weights
    word_tokenizer(NUM_WORDS, chat_template=True).save_pretrained(model_dir)
    memory = KVCacheMemory(memos_config(model_dir))
    messages = [
        {"role": "system", "content": sample_text(300, 1, NUM_WORDS)},
        {"role": "user", "content": sample_text(300, 2, NUM_WORDS)},
    ]
    prompt = memory.vllm_prompt_ids(messages, sample_text(40, 3, NUM_WORDS))
    server = start_server(tmp_path)
    engines: list[EngineProc] = []
    try:
        config = kv_transfer_config(server.socket, retry_interval_s=0.2)
        builder = EngineProc.start("builder", model_dir, tmp_path, kv_config=config, env=ONE_THREAD)
        engines.append(builder)
        ids = memory.build_vllm_kv_cache(messages, lambda ids: builder.generate([ids], 1))
        assert prompt[: len(ids)] == ids and len(ids) >= 2 * CHUNK
        builder.close()
        hit = len(ids) // CHUNK * CHUNK  # the connector stores whole chunks

        ref = EngineProc.start("ref", model_dir, tmp_path, env=ONE_THREAD)  # no connector
        engines.append(ref)
        ref.generate([ids], 1)  # the prefix in vLLM's own prefix cache, computed as above
        own = ref.generate([prompt], 16)[0]
        assert own["num_cached_tokens"] == hit
        expected = own["token_ids"]
        ref.close()

        fresh = EngineProc.start("fresh", model_dir, tmp_path, kv_config=config, env=ONE_THREAD)
        engines.append(fresh)
        before = fresh.metrics()
        out = fresh.generate([prompt], 16)[0]
        assert out["num_cached_tokens"] == hit
        assert delta(fresh.metrics(), before, EXT_HITS) == hit
        assert out["token_ids"] == expected
    finally:
        for engine in engines:
            engine.close()
        server.cleanup()

"""``bench workload``: the trace, the parameters, Prometheus parsing, and the quick mode end
to end against ``vllm serve`` driven by ``vllm bench serve`` (structure and sanity, never
timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcache_svc_bench.report import Progress
from lmcache_svc_bench.runner import BenchContext, run_benchmark
from lmcache_svc_bench.vllm.engines import VLLM_PYTHON
from lmcache_svc_bench.workload import params
from lmcache_svc_bench.workload_report import ideal_hit_rate
from lmcache_svc_bench.workload_serve import Metrics
from lmcache_svc_bench.workload_trace import Conversations, trace_lines, write_tokenizer


def _ctx(tmp_path: Path, **options: str) -> BenchContext:
    return BenchContext("workload", True, tmp_path, tmp_path, Progress("workload"), dict(options))


def _conversations(**kw: int) -> Conversations:
    base = dict(
        num_users=3, num_turns=2, num_system_prompts=2, system_tokens=256,
        turn_tokens=128, output_tokens=4, block_tokens=128,
    )  # fmt: skip
    return Conversations(**{**base, **kw})


def test_trace_interleaves_users_and_grows_each_history() -> None:
    lines = trace_lines(_conversations())
    assert [line["input_length"] for line in lines] == [384] * 3 + [512] * 3
    ids = [line["hash_ids"] for line in lines]
    # system prompts 0-1 and 2-3, alternating by user; every turn appends fresh blocks
    assert ids[:3] == [[0, 1, 4], [2, 3, 5], [0, 1, 6]]
    assert ids[3:] == [[0, 1, 4, 7], [2, 3, 5, 8], [0, 1, 6, 9]]
    assert [line["timestamp"] for line in lines] == list(range(6))


def test_ideal_hit_rate_counts_shared_system_prompts_and_histories() -> None:
    # turn 1: users 0,1 miss; user 2 hits system prompt 0 (256 of 384 tokens);
    # turn 2: every user hits its whole previous prompt (384 of 512)
    expected = (256 + 3 * 384) / (3 * 384 + 3 * 512)
    assert ideal_hit_rate(_conversations()) == pytest.approx(expected)


def test_conversations_reject_partial_blocks_and_overlong_turns() -> None:
    with pytest.raises(ValueError, match="multiple of block_tokens"):
        _conversations(turn_tokens=100).check(8192)
    with pytest.raises(ValueError, match="max_model_len"):
        _conversations(num_turns=100).check(8192)
    with pytest.raises(ValueError, match="num_users"):
        _conversations(num_users=0).check(8192)


def test_params_reject_a_kv_space_that_never_evicts_or_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="never evict"):
        params(_ctx(tmp_path, num_blocks="1000"))
    with pytest.raises(ValueError, match="could not hold"):
        params(_ctx(tmp_path, num_blocks="10"))
    with pytest.raises(ValueError, match="configs"):
        params(_ctx(tmp_path, configs="plain,bogus"))
    assert params(_ctx(tmp_path, num_users="12")).conversations.num_users == 12


def test_tokenizer_is_word_level_over_the_model_vocabulary(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    tokenizer = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    assert len(vocab) == 1024 and vocab["t3"] == 3 and vocab["</s>"] == 2
    assert sorted(vocab.values()) == list(range(1024))


def test_metrics_sum_series_by_labels() -> None:
    text = (
        "# HELP vllm:prompt_tokens_by_source_total x\n"
        'vllm:prompt_tokens_by_source_total{model_name="m",source="local_compute"} 10.0\n'
        'vllm:prompt_tokens_by_source_total{model_name="m",source="external_kv_transfer"} 5.0\n'
        "lmcache_svc_lookup_chunks_total 7\n"
    )
    metrics = Metrics(text)
    assert metrics.sum("vllm:prompt_tokens_by_source_total") == 15.0
    assert metrics.sum("vllm:prompt_tokens_by_source_total", source="local_compute") == 10.0
    assert metrics.sum("lmcache_svc_lookup_chunks_total") == 7.0
    assert metrics.sum("missing") == 0.0


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_quick_mode_end_to_end(tmp_path: Path) -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} is missing: run scripts/setup_vllm.sh first")
    report = run_benchmark("workload", quick=True, out_dir=tmp_path)
    num_requests = (
        report.data["params"]["conversations"]["num_users"]
        * (report.data["params"]["conversations"]["num_turns"])
    )
    results = {r["name"]: r for r in report.data["results"]}
    assert sorted(results) == ["arena", "plain", "ssd"]
    for r in results.values():
        assert r["client"]["completed"] == num_requests and r["client"]["failed"] == 0
        assert r["client"]["mean_ttft_ms"] > 0 and r["client"]["request_throughput"] > 0
        assert r["vllm"]["prefix_cache_queries"] > 0
        assert r["command"].startswith("PYTHONHASHSEED=0 vllm bench serve --backend openai")
    assert results["plain"]["vllm"]["external_prefix_cache_hits"] == 0
    for name in ("arena", "ssd"):  # the server served hits that vLLM had evicted
        assert results[name]["vllm"]["external_prefix_cache_hits"] > 0
        assert results[name]["vllm"]["prompt_tokens_external_kv_transfer"] > 0
        # bytes read from the tiers count every load
        side = results[name]["sidecar"]
        assert sum(v for k, v in side.items() if k.startswith("read_bytes_")) > 0
        # the server's lookup counters count every lookup, over gRPC or reported
        assert side["lookup_chunks"] >= side["lookup_hit_chunks"] > 0
    # With the arena alone the plugin answers every lookup from the shm index; the hits
    # reach the server's counters through its reports (the last scrape waits one interval).
    # (With an SSD below, a partial hit is not final there and goes over gRPC.)
    arena = results["arena"]["sidecar"]
    assert arena["index_lookups"] > 0
    assert arena["lookup_hit_chunks"] == arena["chunk_hits_cpu"] > 0
    ssd = results["ssd"]["sidecar"]
    assert any(k.startswith("written_bytes_") and "ssd" in k and v > 0 for k, v in ssd.items())
    assert report.data["checks_ok"]
    assert (tmp_path / "workload.md").exists() and (
        tmp_path / "workload-client-plain.json"
    ).exists()

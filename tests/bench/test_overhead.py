"""``bench overhead``: parameters, and the quick mode end to end on real vLLM engines
(structure and sanity only, never timings)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lmcache_svc_bench.overhead import TARGET_RATIO, RunResult, paired_ratios, params, verdict
from lmcache_svc_bench.runner import BenchContext, run_benchmark
from lmcache_svc_bench.stats import median_interval
from lmcache_svc_bench.vllm.engines import VLLM_PYTHON


def _ctx(tmp_path: Path, **options: str) -> BenchContext:
    return BenchContext("overhead", True, tmp_path, tmp_path, print, dict(options))


def test_params_reject_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="min_len"):
        params(_ctx(tmp_path, min_len="3000", max_len="2000"))
    with pytest.raises(ValueError, match="min_len"):
        params(_ctx(tmp_path, max_len="9000"))
    with pytest.raises(ValueError, match="positive"):
        params(_ctx(tmp_path, rounds="0"))
    assert params(_ctx(tmp_path, rounds="5")).rounds == 5


def _runs(pairs: list[tuple[float, float]], hook_ms: float) -> list[RunResult]:
    """Rounds of (plain, plugin) tokens/s, each engine 1 s per round."""
    out = []
    for i, (plain, plugin) in enumerate(pairs, 1):
        out.append(RunResult("plain", i, plain, 1.0, 1.0, int(plain), 0))
        out.append(RunResult("plugin", i, plugin, 1.0, 1.0, int(plugin), 0, hook_ms, 10, 1.0))
    return out


def test_paired_ratios_pair_each_rounds_engines() -> None:
    runs = _runs([(100, 99), (200, 202), (50, 40)], hook_ms=1.0)
    assert paired_ratios(runs) == [0.99, 1.01, 0.8]
    assert paired_ratios(runs[:-1]) == [0.99, 1.01]  # an unfinished round is left out


def test_median_interval_brackets_the_median() -> None:
    values = [0.9, 0.95, 1.0, 1.02, 1.05, 1.1, 1.2]
    low, high = median_interval(values)
    assert min(values) <= low <= 1.02 <= high <= max(values) and low < high
    assert median_interval([1.0]) == (1.0, 1.0)
    assert median_interval(values, seed=1) == median_interval(values, seed=1)


def test_verdict_is_met_only_when_resolved() -> None:
    tight = [(100, 100 - d) for d in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6)]  # ratios >= 0.994
    assert verdict(_runs(tight, hook_ms=50.0)).met  # the A/B resolves it, whatever the hooks
    assert verdict(_runs(tight, hook_ms=50.0)).basis.startswith("A/B")
    noisy = [(100, p) for p in (80, 90, 95, 100, 105, 110, 120)]  # spans the target
    assert verdict(_runs(noisy, hook_ms=5.0)).met  # 0.5% in hooks, 0.1% in threads
    assert verdict(_runs(noisy, hook_ms=5.0)).cost_bound == pytest.approx(0.006)
    assert not verdict(_runs(noisy, hook_ms=9.5)).met  # 0.95% + 0.1%
    assert not verdict(_runs(noisy, hook_ms=20.0)).met  # 2% in hooks
    slow = [(100, p) for p in (90, 91, 92, 93, 94)]  # a resolved 6-10% cost
    v = verdict(_runs(slow, hook_ms=1.0))
    assert v.high < TARGET_RATIO and not v.met and v.cost_bound == pytest.approx(1 - v.high)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_quick_mode_end_to_end(tmp_path: Path) -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} is missing: run scripts/setup_vllm.sh first")
    report = run_benchmark("overhead", quick=True, out_dir=tmp_path)
    rounds = report.data["params"]["rounds"]
    runs = report.tables[0].rows
    assert sorted((r[0], r[1]) for r in runs) == sorted(
        (i, e) for i in range(1, rounds + 1) for e in ("plain", "plugin")
    )
    for _, engine, tokens_per_s, requests_per_s, seconds, cached, share, both in runs:
        assert math.isfinite(tokens_per_s) and tokens_per_s > 0
        assert requests_per_s > 0 and seconds > 0
        assert cached == 0  # unique prompts: no hit, neither in vLLM nor from the server
        assert (share != "") == (engine == "plugin") == (both != "")
    data = json.loads((tmp_path / "overhead.json").read_text())["data"]
    assert len(data["paired_ratios"]) == rounds
    v = data["verdict"]
    assert v["low"] <= v["ratio"] <= v["high"] and v["low"] > 0
    assert 0 < v["hook_share"] < 1  # the hooks ran, and took less than the whole round
    assert v["hook_share"] < v["plugin_share"] < 1  # the plugin's threads did some work
    for run in data["runs"]:  # every plugin round has its own hook time
        assert (run["hook_ms"] is not None and run["hook_ms"] > 0) == (run["engine"] == "plugin")
    stats = data["plugin_stats"]
    num_prompts = report.data["params"]["num_prompts"]
    assert stats["lookups"] == rounds * num_prompts  # every measured prompt was looked up
    assert stats["save_chunks"] > 0  # ... and its chunks stored
    assert "lookup_hit_tokens" not in stats  # ... and nothing ever hit
    assert stats["scheduler_hook_ms"] > 0 and stats["worker_hook_ms"] > 0
    assert stats["hook_calls"] >= rounds * num_prompts  # at least a lookup hook per prompt
    assert stats["background_cpu_ms"] > 0

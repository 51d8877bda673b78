"""``bench overhead``: parameters, and the quick mode end to end on real vLLM engines
(structure and sanity only, never timings)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lmcache_svc.bench.overhead import params
from lmcache_svc.bench.runner import BenchContext, run_benchmark
from lmcache_svc.bench.vllm.engines import VLLM_PYTHON


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


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_quick_mode_end_to_end(tmp_path: Path) -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} is missing: run scripts/setup_vllm.sh first")
    report = run_benchmark("overhead", quick=True, out_dir=tmp_path)
    runs = report.tables[0].rows
    assert sorted((r[0], r[1]) for r in runs) == [
        (1, "plain"), (1, "plugin"), (2, "plain"), (2, "plugin"),
    ]  # fmt: skip
    for _, _, tokens_per_s, requests_per_s, seconds, cached in runs:
        assert math.isfinite(tokens_per_s) and tokens_per_s > 0
        assert requests_per_s > 0 and seconds > 0
        assert cached == 0  # unique prompts: no hit, neither in vLLM nor from the server
    ratio = report.tables[1].rows[1][2]
    assert math.isfinite(ratio) and ratio > 0
    stats = json.loads((tmp_path / "overhead.json").read_text())["data"]["plugin_stats"]
    num_prompts = report.data["params"]["num_prompts"]
    assert stats["lookups"] == 2 * num_prompts  # every measured prompt was looked up
    assert stats["save_chunks"] > 0  # ... and its chunks stored
    assert "lookup_hit_tokens" not in stats  # ... and nothing ever hit

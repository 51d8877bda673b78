"""``bench hitcost``: the phases read off one request's marks, and the quick mode end to end
on real vLLM engines (structure and sanity only, never timings)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lmcache_svc_bench.hitcost import Sample, _phase_times
from lmcache_svc_bench.runner import run_benchmark
from lmcache_svc_bench.vllm.engines import VLLM_PYTHON


def test_a_request_splits_into_phases_in_order() -> None:
    marks = [
        (0.0, "ttft.add"), (1.0, "get_num_new_matched_tokens>"),
        (1.2, "get_num_new_matched_tokens<"), (1.5, "build_connector_meta>"),
        (3.5, "bind_connector_metadata>"), (4.0, "start_load_kv>"),
        (5.5, "wait_for_layer_load>"), (9.0, "wait_for_layer_load>"),
        (20.0, "wait_for_save>"), (22.0, "ttft.first"),
    ]  # fmt: skip
    assert _phase_times(Sample(22.0, 512, marks)) == pytest.approx([1.0, 0.5, 2.0, 2.0, 14.5, 2.0])
    # A request without the connector's marks (vLLM's own engine) has no phases.
    assert _phase_times(Sample(20.0, 512, [(0.0, "ttft.add"), (20.0, "ttft.first")])) is None


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_quick_mode_end_to_end(tmp_path: Path) -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} is missing: run scripts/setup_vllm.sh first")
    report = run_benchmark("hitcost", quick=True, out_dir=tmp_path)
    ttfts, phases = report.tables
    assert [(r[0], r[1]) for r in ttfts.rows] == [
        (583, "(c)"),
        (583, "(cn)"),
        (583, "(cp)"),
        (583, "(b)"),
    ]
    for row in ttfts.rows:
        assert math.isfinite(row[2]) and row[2] > 0
        assert row[6] == 512  # every engine served the context's whole chunks from a cache
    assert ttfts.rows[0][3] == 0  # (c) minus itself
    assert [r[1] for r in phases.rows] == ["(cn)", "(cp)", "(b)"]
    for row in phases.rows:
        assert all(v >= 0 for v in row[2:]) and sum(row[2:-1]) <= row[-1] + 1
    (target,) = report.targets
    assert math.isfinite(target.value)

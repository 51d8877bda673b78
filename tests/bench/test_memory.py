"""Smoke test of ``bench memory`` on a tiny matrix: structure and sanity, never timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from lmcache_svc_bench.runner import run_benchmark  # noqa: E402


def test_small_matrix(tmp_path: Path) -> None:
    options = {"contexts": "64,96", "queries": "16", "reps": "1", "hidden": "64", "layers": "1"}
    report = run_benchmark("memory", quick=True, out_dir=tmp_path, options=options)
    ttft, fetch = report.tables
    assert [row[:2] for row in ttft.rows] == [[64, 16], [96, 16]]
    assert all(row[9] == "yes" for row in ttft.rows)  # identical greedy output
    assert all(row[4] > 0 and row[5] > 0 for row in ttft.rows)
    assert [row[0] for row in fetch.rows] == [64, 96]
    assert fetch.rows[1][1] > fetch.rows[0][1] > 0  # a longer context is a bigger blob
    data = json.loads((tmp_path / "memory.json").read_text())
    assert data["data"]["params"]["contexts"] == [64, 96]

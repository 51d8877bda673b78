"""Smoke test of ``bench scale`` in quick mode: structure and sanity, never timings."""

from __future__ import annotations

import json
import math
import mmap
import os
from pathlib import Path

import pytest

from lmcache_svc_bench.runner import run_benchmark
from lmcache_svc_bench.scale import TARGET_BYTES_PER_CHUNK, private_bytes


def test_private_bytes_grows_with_private_memory() -> None:
    # A fresh anonymous mapping: a bytearray could reuse heap pages freed earlier in this
    # process, already counted as private, and then nothing would grow.
    with mmap.mmap(-1, 64 * 2**20) as block:
        before = private_bytes(os.getpid())
        block[:: mmap.PAGESIZE] = b"\x01" * len(block[:: mmap.PAGESIZE])  # touch every page
        after = private_bytes(os.getpid())
    assert after - before >= 60 * 2**20


def test_bad_steps_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="steps"):
        run_benchmark("scale", quick=True, out_dir=tmp_path, options={"steps": "5000,1000"})


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_mode(tmp_path: Path) -> None:
    report = run_benchmark(
        "scale",
        quick=True,
        out_dir=tmp_path,
        options={"steps": "1000,10000,30000", "tracemalloc_chunks": "10000", "iters": "50"},
    )
    data = json.loads((tmp_path / "scale.json").read_text())["data"]
    assert [s["chunks"] for s in data["index_steps"]] == [1000, 10000, 30000]
    for step in data["index_steps"][1:]:
        assert step["private_bytes"] > 0 and math.isfinite(step["bytes_per_chunk"])
    assert 0 < data["tracemalloc_bytes_per_chunk"] < 10_000
    loads = data["load"]
    assert [r["chunks"] for r in loads] == [1, 4, 16, 64]
    for r in loads:
        assert min(r["shm_s"], r["copy_s"], r["copy_4k_s"], r["rpc_s"]) > 0
    titles = [t.title for t in report.tables]
    assert titles[0].startswith("Server memory per indexed chunk")
    assert any(t.startswith("Load time vs prefix length") for t in titles)
    assert {Path(p).name for p in report.plots} <= {"scale_lookup.png", "scale_load.png"}
    for plot in report.plots:
        assert Path(plot).stat().st_size > 0
    (target,) = report.targets
    assert target.name == "server memory per indexed chunk at 30,000 chunks"
    # the growth since the first step over the chunks added since, as the data records it
    first, last = data["index_steps"][0], data["index_steps"][-1]
    growth = (last["private_bytes"] - first["private_bytes"]) / (last["chunks"] - first["chunks"])
    assert target.value == growth == last["bytes_per_chunk"]
    assert target.goal == TARGET_BYTES_PER_CHUNK and target.lower_is_better
    marginal = f"{last['marginal_bytes_per_chunk']:.0f} B per chunk since the previous step"
    assert target.why_missed.startswith(marginal)

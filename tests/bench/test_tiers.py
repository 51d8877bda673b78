"""``bench tiers``: the quick mode end to end (structure and sanity, no timings), bad input."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from lmcache_svc_bench.runner import run_benchmark
from lmcache_svc_bench.stats import median
from lmcache_svc_bench.tiers import MIB, REDIS_GOALS, SSD_GOAL
from lmcache_svc_bench.tiers_ssd import SsdParams, check_params, measure_ssd, scratch_dir

NEEDS_REDIS = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None,
    reason="redis-server and redis-benchmark are needed",
)
NEEDS_DD = pytest.mark.skipif(shutil.which("dd") is None, reason="dd is needed")


def _positive(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
@NEEDS_REDIS
@NEEDS_DD
def test_quick_mode_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    ssd_dir = tmp_path / "disk"
    ssd_dir.mkdir()
    options = {"ssd_dir": str(ssd_dir), "rounds": "2", "ssd_total_mib": "64"}
    report = run_benchmark("tiers", quick=True, out_dir=out, options=options)

    ssd, redis_table = report.tables
    assert [row[0].split()[0] for row in ssd.rows] == ["dd", "SsdTier", "SsdTier"]
    for row in ssd.rows:
        assert all(_positive(cell) for cell in row[1:5]), row
        # O_DIRECT reads: the block layer fetched (about) every byte asked for
        assert int(row[5].rstrip("%")) >= 90, row
    assert report.data["ssd"]["identical"] is True

    cases = [(row[1], row[2]) for row in redis_table.rows]
    assert cases == [
        (op, path)
        for op in ("SET new", "SET overwrite", "GET")
        for path in ("redis-benchmark", "naive redis-py", "RedisTier")
    ]
    assert all(row[0] == "1 MiB" and _positive(row[3]) for row in redis_table.rows)
    assert report.data["redis_identical"] is True

    names = [t.name for t in report.targets]
    assert names[:2] == [
        "SSD write, one chunk at a time / dd",
        "SSD read, one chunk at a time / dd",
    ]
    assert len(names) == 2 + 3 * 2
    ssd_rates = {key: median(rates) for key, rates in report.data["ssd"]["rates_gbps"].items()}
    for target, op in zip(report.targets[:2], ("write", "read")):
        # the ratio is this run's tier rate over this run's dd rate, and a miss says both
        assert target.value == ssd_rates[f"tier single {op}"] / ssd_rates[f"dd {op}"], target
        assert target.goal == SSD_GOAL and _positive(target.value)
        spread = r"[\d.]+-[\d.]+ GB/s"
        assert re.match(rf"tier {spread} against dd {spread} over 2 rounds", target.why_missed)
    for target in report.targets[2:]:
        case, baseline = target.name.removeprefix("Redis ").split(": tier / ")
        op = case.removesuffix(" 1 MiB")

        def gbps(path: str, op: str = op) -> float:
            return median([phase["gbps"] for phase in report.data["redis"][f"{path} {op} {MIB}"]])

        assert target.value == gbps("RedisTier") / gbps(baseline), target
        assert target.goal == REDIS_GOALS[baseline] and _positive(target.value)
        why = target.why_missed  # a miss names both paths' rates, or why the goal is out of reach
        if baseline == "naive redis-py" and gbps("redis-benchmark") < 2 * gbps(baseline):
            assert why.startswith("out of reach here: redis-benchmark itself"), target
        else:
            assert f"RedisTier {gbps('RedisTier'):.2f} GB/s" in why, target
            assert f"{baseline} {gbps(baseline):.2f} GB/s" in why, target

    saved = json.loads((out / "tiers.json").read_text())
    assert saved["mode"] == "quick" and len(saved["targets"]) == len(names)
    assert "### Targets" in (out / "tiers.md").read_text()
    assert {Path(p).name for p in report.plots} <= {"tiers_ssd.png", "tiers_redis.png"}
    for plot in report.plots:
        assert Path(plot).stat().st_size > 0
    assert list(ssd_dir.iterdir()) == []  # the scratch directory is gone


@NEEDS_DD
def test_ssd_measures_from_the_device(tmp_path: Path) -> None:
    params = SsdParams(scratch_dir(tmp_path), 1 << 20, 8 << 20, batch_chunks=4, rounds=1)
    results = measure_ssd(params, lambda message: None)
    assert results.identical
    assert set(results.rates) == {f"{p} {op}" for p in ("dd", "tier single", "tier batched")
                                  for op in ("write", "read")}  # fmt: skip
    assert all(_positive(rates[0]) for rates in results.rates.values())
    assert all(ratio[0] >= 0.9 for ratio in results.device_read.values())


def test_bad_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="only="):
        run_benchmark("tiers", quick=True, out_dir=tmp_path, options={"only": "tape"})
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="not an existing directory"):
        run_benchmark("tiers", quick=True, out_dir=tmp_path, options={"ssd_dir": missing})
    with pytest.raises(ValueError, match="multiple of"):
        check_params(SsdParams(tmp_path, 1000, 8 << 20, batch_chunks=1, rounds=1))
    with pytest.raises(RuntimeError, match="MiB free"):
        check_params(SsdParams(tmp_path, 1 << 20, 1 << 60, batch_chunks=1, rounds=1))

"""The benchmark framework: reports, targets, percentiles and the ``bench`` command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcache_svc.cli import main
from lmcache_svc_bench import BENCHMARKS
from lmcache_svc_bench.report import Progress, Report, Target, targets_at_a_glance
from lmcache_svc_bench.runner import BenchContext, run_benchmark
from lmcache_svc_bench.stats import gbps, median, percentile


def test_target_direction() -> None:
    assert Target("store", 9.0, 8.0).met
    assert not Target("store", 7.9, 8.0).met
    assert Target("p99", 0.8, 1.0, lower_is_better=True).met
    assert not Target("p99", 1.2, 1.0, lower_is_better=True).met


def test_report_markdown_and_json(tmp_path: Path) -> None:
    report = Report("demo", "quick", "a demo")
    table = report.table("Throughput", ["path", "GB/s", "copy GB/s"])
    table.add("shm store", 7.25, 9.0)
    table.notes.append("copy measured in the same process")
    report.target("store vs copy", 0.81, 0.8)
    report.target("lookup p99", 2.5, 1.0, unit=" ms", lower_is_better=True, why_missed="GIL")
    json_path, md_path = report.write(tmp_path)

    md = md_path.read_text()
    assert "| shm store | 7.25 | 9.00 |" in md
    assert "- copy measured in the same process" in md
    assert "| store vs copy | 0.81 | >= 0.80 | met |" in md
    assert "| lookup p99 | 2.50 ms | <= 1.00 ms | MISSED: GIL |" in md
    data = json.loads(json_path.read_text())
    assert data["tables"][0]["rows"] == [["shm store", 7.25, 9.0]]
    assert [t["met"] for t in data["targets"]] == [True, False]
    assert data["machine"]["cpus"] > 0


def test_targets_at_a_glance_lists_every_report() -> None:
    ttft = Report("ttft", "full")
    ttft.target("b / c", 1.05, 1.1, lower_is_better=True)
    lookup = Report("lookup", "full")
    lookup.target("p99", 2.5, 1.0, unit=" ms", lower_is_better=True, why_missed="GIL")
    lookup.target("ratio", 6.0, 5.0)
    md = targets_at_a_glance([ttft, lookup, Report("soak", "full")])
    assert "| ttft | b / c | 1.05 | <= 1.10 | met |" in md
    assert "| lookup | p99 | 2.50 ms | <= 1.00 ms | MISSED: GIL |" in md
    assert "- 2 of 3 target(s) met" in md


def test_table_rejects_wrong_number_of_cells() -> None:
    table = Report("demo", "quick").table("t", ["a", "b"])
    with pytest.raises(ValueError, match="1 cells for 2 columns"):
        table.add(1)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0
    assert median([1.0, 3.0, 2.0]) == 2.0
    assert gbps(2e9, 2.0) == 1.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_context_option_conversion(tmp_path: Path) -> None:
    ctx = BenchContext("demo", True, tmp_path, tmp_path, Progress("demo"), {"n": "5", "on": "1"})
    assert ctx.option("n", 1) == 5
    assert ctx.option("on", False) is True
    assert ctx.option("absent", 2.5) == 2.5
    with pytest.raises(ValueError):
        BenchContext("demo", True, tmp_path, tmp_path, Progress("demo"), {"n": "x"}).option("n", 1)


def test_every_benchmark_module_has_run() -> None:
    import importlib

    for name, (module, _) in BENCHMARKS.items():
        assert callable(importlib.import_module(module).run), name


def test_unknown_benchmark_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown benchmark 'nope'"):
        run_benchmark("nope", quick=True, out_dir=tmp_path)


def test_cli_rejects_bad_set(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "lookup", "--quick", "--set", "novalue"]) == 2
    assert "--set wants KEY=VALUE" in capsys.readouterr().err


def test_cli_rejects_unknown_name() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "nope"])
    assert exc.value.code == 2

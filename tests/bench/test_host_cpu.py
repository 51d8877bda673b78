"""The host's stolen CPU time: read from /proc/stat, reported, and a bar to judging timings."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from lmcache_svc.cli import main
from lmcache_svc_bench import BENCHMARKS, runner
from lmcache_svc_bench.host_cpu import MAX_STEAL, CpuTimes, steal_share
from lmcache_svc_bench.report import Report


def write_stat(path: Path, line: str) -> Path:
    path.write_text(line + "\ncpu0 1 2 3 4 5 6 7 8 0 0\nintr 12345\n")
    return path


def test_reads_busy_and_stolen_ticks(tmp_path: Path) -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat = write_stat(tmp_path / "stat", "cpu  100 5 20 900 7 3 2 40 0 0")
    assert CpuTimes.read(stat) == CpuTimes(busy=100 + 5 + 20 + 3 + 2, steal=40)


@pytest.mark.parametrize(
    "line", ["", "intr 1 2 3", "cpu 1 2 3", "cpu  1 2 3 4 5 6 7 x 0 0", "cpu0 1 2 3 4 5 6 7 8"]
)
def test_a_file_of_another_layout_reads_as_unknown(tmp_path: Path, line: str) -> None:
    assert CpuTimes.read(write_stat(tmp_path / "stat", line)) is None
    assert CpuTimes.read(tmp_path / "absent") is None


def test_the_share_is_of_the_time_the_cpus_had_work() -> None:
    before = CpuTimes(busy=1_000, steal=50)
    assert steal_share(before, CpuTimes(busy=1_900, steal=150)) == pytest.approx(0.1)
    assert steal_share(before, CpuTimes(busy=2_000, steal=50)) == 0.0
    assert steal_share(before, before) is None  # nothing ran
    assert steal_share(None, before) is None
    assert steal_share(before, None) is None
    assert steal_share(before, CpuTimes(busy=900, steal=60)) is None  # counters went back


def report_with_targets() -> Report:
    report = Report("demo", "quick")
    report.target("copy vs memcpy", 0.95, 0.9)
    report.target("p99", 0.5, 1.0, unit=" ms", lower_is_better=True)
    report.target("wrong bytes", 0.0, 0.0, lower_is_better=True, timing=False)
    return report


def test_a_run_with_more_stolen_time_judges_no_timing() -> None:
    report = report_with_targets()
    report.judge_host(MAX_STEAL + 0.01)
    timed, _, count = report.targets
    assert not timed.met and "the hypervisor took" in timed.not_evaluated
    assert [t.met for t in report.targets] == [False, False, True]  # counts are still judged
    md = report.to_markdown()
    assert f"the hypervisor took {MAX_STEAL + 0.01:.1%} of its busy CPU time" in md
    assert "| copy vs memcpy | 0.95 | >= 0.90 | NOT EVALUATED: the hypervisor took" in md
    assert "| wrong bytes | 0 | <= 0 | met |" in md


@pytest.mark.parametrize("steal", [0.0, MAX_STEAL, None])
def test_a_quiet_host_or_an_unknown_one_judges_every_target(steal: float | None) -> None:
    report = report_with_targets()
    report.judge_host(steal)
    assert [t.met for t in report.targets] == [True, True, True]
    assert ("the hypervisor took" in report.to_markdown()) == (steal is not None)


@pytest.fixture
def stolen_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark "demo" with one timing target met, run while 20% of the time is stolen."""
    module = types.ModuleType("demo_bench")

    def run(ctx: runner.BenchContext) -> Report:
        report = ctx.report("demo")
        report.target("a rate", 2.0, 1.0)
        return report

    module.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "demo_bench", module)
    monkeypatch.setitem(BENCHMARKS, "demo", ("demo_bench", "a demo"))
    readings = iter([CpuTimes(busy=1_000, steal=0), CpuTimes(busy=1_800, steal=200)])
    monkeypatch.setattr(runner.CpuTimes, "read", lambda: next(readings))


@pytest.mark.usefixtures("stolen_demo")
def test_the_runner_reports_the_steal_of_the_run(tmp_path: Path) -> None:
    report = runner.run_benchmark("demo", quick=True, out_dir=tmp_path)
    assert report.machine["steal"] == pytest.approx(0.2)
    assert not report.targets[0].met
    data = json.loads((tmp_path / "demo.json").read_text())
    assert data["machine"]["steal"] == pytest.approx(0.2)
    assert data["targets"][0]["not_evaluated"].startswith("the hypervisor took 20%")


@pytest.mark.usefixtures("stolen_demo")
def test_the_command_counts_targets_not_evaluated_apart_from_misses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "demo", "--quick", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "1 target(s) not evaluated" in err and "missed" not in err


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="no /proc/stat: not Linux")
def test_this_linux_host_reads() -> None:
    now = CpuTimes.read()
    assert now is not None and now.busy > 0 and now.steal >= 0

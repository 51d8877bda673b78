"""What a benchmark produces: tables of figures next to their baselines, targets, progress.

Every benchmark returns one ``Report``. The command writes it as ``<name>.json`` (all the
figures, for tools) and ``<name>.md`` (the tables, for people and docs/benchmarks.md), and
prints the markdown. A ``Target`` states a goal from the issue tracker against a figure
measured in the same run; a missed target is reported, never hidden, and never fails the run.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from lmcache_svc_bench.host_cpu import MAX_STEAL


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(
                f"table {self.title!r}: {len(cells)} cells for {len(self.columns)} columns"
            )
        self.rows.append(list(cells))

    def to_markdown(self) -> str:
        lines = [f"### {self.title}", ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + " --- |" * len(self.columns))
        for row in self.rows:
            lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
        lines += ["", *(f"- {note}" for note in self.notes)]
        return "\n".join(lines).rstrip() + "\n"


@dataclass
class Target:
    """``value`` against ``goal``: met when value >= goal (or <= goal with ``lower_is_better``)."""

    name: str
    value: float
    goal: float
    unit: str = ""
    lower_is_better: bool = False
    why_missed: str = ""
    not_evaluated: str = ""  # why this run cannot judge it (then never met, whatever the value)
    timing: bool = True  # a time or a rate, which a host short of CPU skews (not a count)

    @property
    def met(self) -> bool:
        if self.not_evaluated:
            return False
        return self.value <= self.goal if self.lower_is_better else self.value >= self.goal

    def to_markdown_row(self) -> list[Any]:
        sign = "<=" if self.lower_is_better else ">="
        if self.not_evaluated:
            verdict = f"NOT EVALUATED: {self.not_evaluated}"
        elif self.met:
            verdict = "met"
        else:
            verdict = "MISSED" + (f": {self.why_missed}" if self.why_missed else "")
        return [
            self.name,
            f"{_cell(self.value)}{self.unit}",
            f"{sign} {_cell(self.goal)}{self.unit}",
            verdict,
        ]


@dataclass
class Report:
    name: str
    mode: str
    description: str = ""
    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    plots: list[str] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=lambda: machine_info())
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    elapsed_s: float = 0.0

    def table(self, title: str, columns: list[str]) -> Table:
        table = Table(title, columns)
        self.tables.append(table)
        return table

    def target(self, *args: Any, **kwargs: Any) -> Target:
        target = Target(*args, **kwargs)
        self.targets.append(target)
        return target

    def judge_host(self, steal: float | None) -> None:
        """Record the share of the run's busy CPU time the hypervisor took (``host_cpu``);
        above ``MAX_STEAL`` the timing targets are not judged: the host, not the code, set
        their figures."""
        self.machine["steal"] = steal
        if steal is None or steal <= MAX_STEAL:
            return
        why = (
            f"the hypervisor took {steal:.0%} of this run's busy CPU time (steal in /proc/stat; "
            f"over {MAX_STEAL:.0%}): the timings are the host's"
        )
        for target in self.targets:
            if target.timing and not target.not_evaluated:
                target.not_evaluated = why

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["targets"] = [{**asdict(t), "met": t.met} for t in self.targets]
        return out

    def to_markdown(self) -> str:
        parts = [f"## bench {self.name} ({self.mode})", ""]
        if self.description:
            parts += [self.description, ""]
        steal = self.machine.get("steal")
        stolen = "" if steal is None else f"; the hypervisor took {steal:.1%} of its busy CPU time"
        parts.append(
            f"Machine: {self.machine['summary']}. Started {self.started}, "
            f"took {self.elapsed_s:.0f} s{stolen}.\n"
        )
        parts += [t.to_markdown() for t in self.tables]
        if self.targets:
            targets = Table("Targets", ["target", "measured", "goal", "verdict"])
            for t in self.targets:
                targets.add(*t.to_markdown_row())
            parts.append(targets.to_markdown())
        parts += [f"![{Path(p).stem}]({Path(p).name})\n" for p in self.plots]
        return "\n".join(parts)

    def write(self, out_dir: Path) -> tuple[Path, Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path = out_dir / f"{self.name}.json"
        md_path = out_dir / f"{self.name}.md"
        json_path.write_text(json.dumps(self.to_json(), indent=1, default=str) + "\n")
        md_path.write_text(self.to_markdown())
        return json_path, md_path


class Progress:
    """One line per step on stderr, with the time since the benchmark began."""

    def __init__(self, name: str, stream: TextIO | None = None) -> None:
        self.name = name
        self.start = time.monotonic()
        self.stream = stream or sys.stderr

    def __call__(self, message: str) -> None:
        elapsed = time.monotonic() - self.start
        print(f"[bench {self.name} {elapsed:6.1f}s] {message}", file=self.stream, flush=True)


def machine_info() -> dict[str, Any]:
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = 0.0
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        pass
    cpus = os.cpu_count() or 0
    summary = f"{cpus} CPUs ({cpu_model or platform.machine()}), {mem_gib:.0f} GiB RAM, " + (
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}"
    )
    return {
        "summary": summary,
        "cpus": cpus,
        "cpu_model": cpu_model,
        "mem_gib": round(mem_gib, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "hostname": platform.node(),
    }


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        if abs(value) >= 0.01:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def targets_at_a_glance(reports: list[Report]) -> str:
    """Every target of several reports in one table (``bench all`` writes it as targets.md)."""
    table = Table("Targets at a glance", ["benchmark", "target", "measured", "goal", "verdict"])
    for report in reports:
        for target in report.targets:
            table.add(report.name, *target.to_markdown_row())
    missed = sum(not t.met for r in reports for t in r.targets)
    total = sum(len(r.targets) for r in reports)
    table.notes.append(f"{total - missed} of {total} target(s) met")
    return table.to_markdown()

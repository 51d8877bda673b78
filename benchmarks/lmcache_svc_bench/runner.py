"""Run benchmarks by name: context, timing, report files, a summary on stdout."""

from __future__ import annotations

import importlib
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from lmcache_svc_bench import BENCHMARKS
from lmcache_svc_bench.host_cpu import CpuTimes, steal_share
from lmcache_svc_bench.report import Progress, Report


@dataclass
class BenchContext:
    name: str
    quick: bool
    out_dir: Path
    work_dir: Path
    progress: Progress
    options: dict[str, str] = field(default_factory=dict)

    @property
    def mode(self) -> str:
        return "quick" if self.quick else "full"

    def report(self, description: str = "") -> Report:
        return Report(self.name, self.mode, description or BENCHMARKS[self.name][1])

    def option(self, key: str, default: Any) -> Any:
        """A ``--set key=value`` override, converted to the default's type."""
        if key not in self.options:
            return default
        raw = self.options[key]
        if isinstance(default, bool):
            return raw.lower() in ("1", "true", "yes", "on")
        return type(default)(raw) if default is not None else raw


def run_benchmark(
    name: str,
    *,
    quick: bool,
    out_dir: Path,
    keep_work: bool = False,
    options: dict[str, str] | None = None,
) -> Report:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}: choose from {', '.join(BENCHMARKS)}")
    module = importlib.import_module(BENCHMARKS[name][0])
    work_dir = Path(tempfile.mkdtemp(prefix=f"lmc-bench-{name}-"))
    progress = Progress(name)
    ctx = BenchContext(name, quick, out_dir, work_dir, progress, dict(options or {}))
    start = time.monotonic()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    progress(f"{ctx.mode} mode; scratch in {work_dir}; results to {out_dir}")
    cpu_before = CpuTimes.read()
    try:
        with _terminate_unwinds():
            report: Report = module.run(ctx)
    finally:
        if keep_work:
            progress(f"kept {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    report.started = started  # the benchmark's start, not the report object's creation
    report.elapsed_s = time.monotonic() - start
    report.judge_host(steal_share(cpu_before, CpuTimes.read()))
    json_path, md_path = report.write(out_dir)
    progress(f"done in {report.elapsed_s:.0f} s: {json_path}, {md_path}")
    return report


@contextmanager
def _terminate_unwinds() -> Iterator[None]:
    """SIGTERM (a ``kill``, a job's timeout) unwinds the benchmark as Ctrl-C does, so its
    engines and servers are stopped and its scratch directory removed; Python's default
    ends the process at once and leaves them running. Main thread only (where signal
    handlers can be set); the previous handler comes back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)

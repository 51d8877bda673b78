"""The plugin's hook-time accounting: a hook's wall time is counted (also when it raises),
the totals reach the stats and the log line, and the accounting itself is cheap."""

from __future__ import annotations

import time

import pytest
from lmcache_svc_vllm.hooks import FLUSH_NS, HookClock, flush, timed
from lmcache_svc_vllm.stats import FirstTokenHold, StatsRecorder, merge, summarize

from tests.helpers import wait_until


class Hooks:
    def __init__(self) -> None:
        self.hook_clock = HookClock()

    @timed
    def sleepy(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    @timed
    def failing(self) -> None:
        time.sleep(0.002)
        raise RuntimeError("boom")

    @timed
    def noop(self) -> None:
        pass

    def bare(self) -> None:
        pass


def test_a_hooks_time_is_counted() -> None:
    hooks = Hooks()
    start = time.perf_counter_ns()
    assert hooks.sleepy(0.01) == "done"
    assert hooks.sleepy(0.005) == "done"
    outside = time.perf_counter_ns() - start
    assert 15_000_000 <= hooks.hook_clock.ns <= outside  # both sleeps, and nothing more
    assert hooks.hook_clock.calls == 2
    with pytest.raises(RuntimeError, match="boom"):
        hooks.failing()
    assert hooks.hook_clock.calls == 3 and hooks.hook_clock.ns >= 17_000_000
    assert hooks.hook_clock.take()[1] == 3
    assert (hooks.hook_clock.ns, hooks.hook_clock.calls) == (0, 0)


def test_totals_reach_the_stats_and_the_log_line() -> None:
    hooks, stats = Hooks(), StatsRecorder()
    hooks.noop()
    flush(hooks.hook_clock, stats, "worker")
    assert stats.take() is None  # under FLUSH_NS and nothing else to send: it waits
    hooks.sleepy(FLUSH_NS / 1e9)
    flush(hooks.hook_clock, stats, "worker")
    worker = stats.take()
    assert worker is not None and worker["worker_hook_ns"] >= FLUSH_NS
    assert worker["hook_calls"] == 2 and hooks.hook_clock.ns == 0  # the early call too

    hooks.noop()  # under FLUSH_NS, but it rides along with other stats
    stats.add(lookups=1)
    flush(hooks.hook_clock, stats, "scheduler")
    scheduler = stats.take()
    assert scheduler is not None and 0 < scheduler["scheduler_hook_ns"] < FLUSH_NS

    line = summarize(merge(worker, scheduler))  # what vLLM logs for both halves
    assert line["worker_hook_ms"] == round(worker["worker_hook_ns"] / 1e6, 3)
    assert line["scheduler_hook_ms"] == round(scheduler["scheduler_hook_ns"] / 1e6, 3)
    assert line["hook_calls"] == 3 and line["lookups"] == 1


def test_stats_wait_out_a_step_that_starts_requests_but_never_two() -> None:
    hold, stats = FirstTokenHold(), StatsRecorder()
    assert hold.take(stats, starts_requests=True) is None  # nothing to hold, nothing held
    stats.add(lookups=1)
    assert hold.take(stats, starts_requests=True) is None  # a first token's step: kept
    stats.add(load_chunks=3)
    taken = hold.take(stats, starts_requests=False)  # the next step: both steps' stats
    assert taken is not None and (taken["lookups"], taken["load_chunks"]) == (1, 3)
    # Steps that all start requests (a prefill-only engine): every other one reports.
    sent = []
    for _ in range(6):
        stats.add(lookups=1)
        data = hold.take(stats, starts_requests=True)
        sent.append(None if data is None else data["lookups"])
    assert sent == [None, 2, None, 2, None, 2]
    assert hold.take(stats, starts_requests=False) is None  # nothing left behind


def test_the_accounting_is_cheap() -> None:
    """What ``timed`` adds to one call, over the bare call: well under a microsecond
    (about 0.2 us measured); the bound is loose for a busy machine."""
    hooks, n = Hooks(), 20_000

    def per_call(fn: object) -> float:
        best = float("inf")
        for _ in range(5):  # the least disturbed of five runs
            start = time.perf_counter_ns()
            for _ in range(n):
                fn()  # type: ignore[operator]
            best = min(best, (time.perf_counter_ns() - start) / n)
        return best

    added_ns = per_call(hooks.noop) - per_call(hooks.bare)
    print(f"timed adds {added_ns:.0f} ns per call")
    assert added_ns < 2_000
    assert hooks.hook_clock.calls == 5 * n


def test_background_tasks_count_their_cpu_time_not_their_waits() -> None:
    stats = StatsRecorder()

    def spin(seconds: float) -> int:
        end, n = time.perf_counter() + seconds, 0
        while time.perf_counter() < end:
            n += 1
        return n

    assert stats.cpu_timed(spin, 0.05) > 0
    spun = stats.take()
    assert spun is not None and spun["background_cpu_ns"] >= 10_000_000  # most of 50 ms
    stats.cpu_timed(time.sleep, 0.05)
    slept = stats.take()
    assert slept is not None and slept["background_cpu_ns"] < 10_000_000  # a wait, no CPU
    assert summarize(spun)["background_cpu_ms"] == round(spun["background_cpu_ns"] / 1e6, 3)
    with pytest.raises(ZeroDivisionError):
        stats.cpu_timed(lambda: 1 / 0)
    failed = stats.take()
    assert failed is not None and failed["background_cpu_ns"] > 0  # counted when it raises


def test_with_tracing_on_every_hook_marks_its_entry_and_exit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``LMCACHE_SVC_VLLM_TRACE`` (read at import, so in a fresh interpreter): a timed hook
    writes ``name>`` and ``name<`` (also when it raises) and still counts its time."""
    import os
    import subprocess
    import sys

    trace_file = tmp_path / "trace.txt"
    script = (
        "from lmcache_svc_vllm.hooks import HookClock, timed\n"
        "class H:\n"
        "    def __init__(self): self.hook_clock = HookClock()\n"
        "    @timed\n"
        "    def ok(self): return 1\n"
        "    @timed\n"
        "    def bad(self): raise RuntimeError('x')\n"
        "h = H(); h.ok()\n"
        "try:\n    h.bad()\nexcept RuntimeError:\n    pass\n"
        "assert h.hook_clock.calls == 2, h.hook_clock.calls\n"
    )
    env = {
        **os.environ,
        "LMCACHE_SVC_VLLM_TRACE": str(trace_file),
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    names = [line.split(" ", 2)[2] for line in trace_file.read_text().splitlines()]
    assert names == ["ok>", "ok<", "bad>", "bad<"]
    stamps = [int(line.split(" ", 1)[0]) for line in trace_file.read_text().splitlines()]
    assert stamps == sorted(stamps)


def test_with_tracing_off_nothing_is_written(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from lmcache_svc_vllm import trace

    monkeypatch.chdir(tmp_path)
    assert not trace.enabled  # the suite runs without LMCACHE_SVC_VLLM_TRACE
    trace.mark("nothing")
    assert list(tmp_path.iterdir()) == []


def test_a_trace_file_that_cannot_be_opened_leaves_tracing_off(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A bad ``LMCACHE_SVC_VLLM_TRACE`` (a directory, a missing parent) never stops the
    plugin from importing: one warning names the file, and no marks are written."""
    import os
    import subprocess
    import sys

    script = "from lmcache_svc_vllm import trace\nassert not trace.enabled\ntrace.mark('x')\n"
    for bad in (tmp_path, tmp_path / "missing" / "trace.txt"):
        env = {
            **os.environ,
            "LMCACHE_SVC_VLLM_TRACE": str(bad),
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert "cannot be opened" in done.stderr and str(bad) in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_reading_marks_skips_a_line_still_being_written(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Engine processes append marks while the driver reads them: a last line without its
    newline (or a torn fragment) is skipped, not a crash of the read."""
    from lmcache_svc_vllm.trace import read_marks

    path = tmp_path / "trace.txt"
    path.write_text("300 7 b<\n100 7 a>\n12345\n200 7 a<\n400 8 load.cop")
    assert read_marks(str(path), 100, 300) == [(100, "a>"), (200, "a<"), (300, "b<")]
    assert read_marks(str(path), 250, 1000) == [(300, "b<")]


def test_a_mark_makes_no_write_the_writer_thread_and_flush_do(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A mark only gathers in memory (no system call on the path it times); the process's
    writer thread appends it within its period, ``flush`` at once."""
    import os

    from lmcache_svc_vllm.trace import TraceFile, read_marks

    held = tmp_path / "held.txt"
    slow = TraceFile(str(held), flush_s=3600.0)
    slow.mark("a>")
    slow.mark("a<")
    assert held.read_text() == ""
    slow.flush()
    lines = held.read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == [f"{os.getpid()} a>", f"{os.getpid()} a<"]
    slow.flush()  # nothing more to write
    assert len(held.read_text().splitlines()) == 2

    written = tmp_path / "written.txt"
    fast = TraceFile(str(written), flush_s=0.01)
    fast.mark("b>")
    wait_until(lambda: read_marks(str(written), 0, 2**63) != [], 30, "the writer thread's write")
    assert [name for _, name in read_marks(str(written), 0, 2**63)] == ["b>"]


def test_a_forked_child_writes_its_own_marks_under_its_own_pid(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A child forked with marks still in memory writes none of its parent's: each
    process writes what it marked, under its pid (vLLM may fork its workers)."""
    import os
    import subprocess
    import sys

    path = tmp_path / "trace.txt"
    script = (
        "import os, sys\n"
        "from lmcache_svc_vllm.trace import TraceFile\n"
        "t = TraceFile(sys.argv[1], flush_s=3600.0)\n"
        "t.mark('parent')\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    t.mark('child')\n"
        "    t.flush()\n"
        "    os._exit(0)\n"
        "os.waitpid(child, 0)\n"
        "t.flush()\n"
        "print(child)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    child_pid = done.stdout.strip()
    owners = sorted(line.split(" ", 1)[1] for line in path.read_text().splitlines())
    parent_pid = next(o.split()[0] for o in owners if o.endswith(" parent"))
    assert owners == sorted([f"{child_pid} child", f"{parent_pid} parent"])
    assert parent_pid != child_pid


def test_marks_that_cannot_be_written_are_dropped_with_one_warning(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """A trace file that stops taking writes (here: read-only) neither stops
    the writer thread nor keeps the marks in memory: they are dropped, with one warning."""
    import logging
    import os

    from lmcache_svc_vllm.trace import TraceFile

    trace_file = TraceFile(str(tmp_path / "trace.txt"), flush_s=0.01)
    read_only = tmp_path / "read-only.txt"
    read_only.write_text("")
    os.close(trace_file._fd)
    trace_file._fd = os.open(read_only, os.O_RDONLY)  # every write fails with EBADF now
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            trace_file.mark("lost")
            wait_until(lambda: not trace_file._marks, 30, "the marks dropped")
    warnings = [r for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(warnings) == 1
    assert trace_file._writer is not None and trace_file._writer.is_alive()
    assert read_only.read_text() == ""

"""Time marks on a request's path through the plugin, for the TTFT benchmark's breakdown.

Off unless ``LMCACHE_SVC_VLLM_TRACE`` names a file in the engine's environment: then every
``mark(name)`` records ``<perf_counter_ns> <pid> <name>``. ``perf_counter`` is
``CLOCK_MONOTONIC`` on Linux, so the marks of vLLM's scheduler and worker processes and of
the benchmark driving the engine share one time line.

A mark costs no system call on the path it measures: it appends to a queue in memory, and
a thread of the process's own (started at its first mark, off vLLM's compute cores) writes
what has gathered every ``FLUSH_S``, as whole lines in one ``O_APPEND`` write (not
interleaved with other processes' lines), and once more at exit; marks it cannot write are
dropped, with one warning. A write per mark put one system call per mark on the timed
path: up to a hit's first token in ``bench hitcost``, 52 for the plugin's engine against 6
(the driver's own) for vLLM's prefix hit. A reader waits ``SETTLE_S`` after its last mark
before reading (``flush`` writes the calling process's own at once).

Each hook of the connector is marked ``<hook>>`` on entry and ``<hook><`` on exit
(``hooks.timed``); inside, the load and save paths mark their phases (``worker.py``) and the
lookup thread its answer (``scheduler.py``). Off, ``mark`` does nothing and the hooks are
wrapped as before (the choice is made when the plugin is imported).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from time import perf_counter_ns

from lmcache_svc_vllm.cores import off_compute_cores

TRACE_ENV = "LMCACHE_SVC_VLLM_TRACE"
FLUSH_S = 0.05
SETTLE_S = 2 * FLUSH_S  # a mark is in the file this long after it was taken
logger = logging.getLogger(f"vllm.{__name__}")


class TraceFile:
    """Marks gathered in memory and appended to ``path`` by a writer thread every
    ``flush_s`` (and by ``flush``)."""

    def __init__(self, path: str, flush_s: float = FLUSH_S) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._flush_s = flush_s
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        """A new process (or a forked child): no marks yet, no writer thread yet."""
        self._pid = os.getpid()
        self._marks: deque[tuple[int, str]] = deque()  # appends and pops are thread-safe
        self._write_lock = threading.Lock()  # a child never inherits it held
        self._writer: threading.Thread | None = None

    def mark(self, name: str) -> None:
        self._marks.append((perf_counter_ns(), name))
        if self._writer is None:
            self._start_writer()

    def flush(self) -> None:
        """Write the marks gathered so far now."""
        with self._write_lock:  # one writer at a time: lines stay in order
            marks = self._marks
            lines = [marks.popleft() for _ in range(len(marks))]  # gone even if the write fails
            if lines:
                pid = self._pid
                os.write(self._fd, "".join(f"{ns} {pid} {n}\n" for ns, n in lines).encode())

    def _start_writer(self) -> None:
        with self._write_lock:  # two threads' first marks start one writer
            if self._writer is not None:
                return
            self._writer = threading.Thread(
                target=self._write_every, name="lmcache-svc-trace", daemon=True
            )
            self._writer.start()
        atexit.register(self.flush)

    def _write_every(self) -> None:
        off_compute_cores()
        warned = False
        while True:  # as long as the process lives (a daemon thread)
            time.sleep(self._flush_s)
            try:
                self.flush()
            except OSError as e:  # a full disk, a closed file: the marks are dropped
                if not warned:
                    logger.warning("lmcache-svc: trace marks cannot be written (%s): dropped", e)
                    warned = True


def _off(name: str) -> None:
    pass


def _from_env() -> TraceFile | None:
    """The trace file: none without the variable, and none (with one warning naming the
    file) when the file cannot be opened: tracing never stops an engine from starting."""
    path = os.environ.get(TRACE_ENV)
    if not path:
        return None
    try:
        return TraceFile(path)
    except OSError as e:
        logger.warning(
            "lmcache-svc: %s=%r cannot be opened (%s); no trace marks", TRACE_ENV, path, e
        )
        return None


_file = _from_env()
mark: Callable[[str], None] = _off if _file is None else _file.mark
enabled = _file is not None


def flush() -> None:
    """Write this process's marks now (nothing when tracing is off)."""
    if _file is not None:
        _file.flush()


def read_marks(path: str, start_ns: int, end_ns: int) -> list[tuple[int, str]]:
    """(ns, name) of the marks in ``[start_ns, end_ns]``, in time order. Other processes
    may be writing meanwhile: a last line not ended yet is left for the next read."""
    out: list[tuple[int, str]] = []
    with open(path) as f:
        for line in f:
            parts = line.split(" ", 2)
            if not line.endswith("\n") or len(parts) != 3 or not parts[0].isdigit():
                continue
            ns, name = int(parts[0]), parts[2].rstrip("\n")
            if start_ns <= ns <= end_ns:
                out.append((ns, name))
    out.sort()
    return out

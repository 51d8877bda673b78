"""Time marks on a request's path through the plugin, for the TTFT benchmark's breakdown.

Off unless ``LMCACHE_SVC_VLLM_TRACE`` names a file in the engine's environment: then every
``mark(name)`` appends one line, ``<perf_counter_ns> <pid> <name>``, with one ``write`` (an
``O_APPEND`` write of a short line is not interleaved with other processes' lines).
``perf_counter`` is ``CLOCK_MONOTONIC`` on Linux, so the marks of vLLM's scheduler and worker
processes and of the benchmark driving the engine share one time line.

Each hook of the connector is marked ``<hook>>`` on entry and ``<hook><`` on exit
(``hooks.timed``); inside, the load and save paths mark their phases (``worker.py``) and the
lookup thread its answer (``scheduler.py``). Off, ``mark`` does nothing and the hooks are
wrapped as before (the choice is made when the plugin is imported).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from time import perf_counter_ns

TRACE_ENV = "LMCACHE_SVC_VLLM_TRACE"
logger = logging.getLogger(f"vllm.{__name__}")


class _TraceFile:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._pid = os.getpid()

    def mark(self, name: str) -> None:
        os.write(self._fd, f"{perf_counter_ns()} {self._pid} {name}\n".encode())


def _off(name: str) -> None:
    pass


def _from_env() -> Callable[[str], None]:
    """The mark function: off without the variable, and off (with one warning naming the
    file) when the file cannot be opened: tracing never stops an engine from starting."""
    path = os.environ.get(TRACE_ENV)
    if not path:
        return _off
    try:
        return _TraceFile(path).mark
    except OSError as e:
        logger.warning(
            "lmcache-svc: %s=%r cannot be opened (%s); no trace marks", TRACE_ENV, path, e
        )
        return _off


mark = _from_env()
enabled = mark is not _off


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

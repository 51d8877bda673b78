"""Wall time spent inside the connector's hooks: what the plugin adds to vLLM's step.

vLLM calls every ``KVConnectorBase_V1`` hook synchronously, on the thread that runs the
scheduler or the forward pass, so the time inside them is the plugin's share of the
engine's critical path (an upper bound: the hooks also wait for the plugin's own threads).
It does not cover the plugin's background threads (lookups, reservations, commits: their
CPU time is counted apart, ``StatsRecorder.cpu_timed``), the server competing for the
cores and the GIL, or vLLM's own connector plumbing around the hooks.

``timed`` wraps a hook: two ``perf_counter_ns`` calls and two int adds on a slotted object,
no allocation of its own (0.2-0.7 us per call, ``tests/vllm/test_hooks.py``). The
connector moves the totals into its stats (``HOOK_COUNTERS`` in ``stats.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any, Literal, Protocol, TypeVar

from lmcache_svc_vllm import trace
from lmcache_svc_vllm.stats import StatsRecorder

F = TypeVar("F", bound=Callable[..., Any])

FLUSH_NS = 1_000_000  # with nothing else to report, hook time waits for 1 ms of it


class HookClock:
    """Running totals since the last ``take``."""

    __slots__ = ("calls", "ns")

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0

    def take(self) -> tuple[int, int]:
        """(ns, calls) since the last take."""
        out = (self.ns, self.calls)
        self.ns = self.calls = 0
        return out


class HasHookClock(Protocol):
    hook_clock: HookClock


def timed(method: F) -> F:
    """Count a hook's wall time (also when it raises) in ``self.hook_clock``; with tracing
    on (``trace.py``), also mark its entry and exit."""

    @functools.wraps(method)
    def wrapper(self: HasHookClock, *args: Any, **kwargs: Any) -> Any:
        start = perf_counter_ns()
        try:
            return method(self, *args, **kwargs)
        finally:
            clock = self.hook_clock
            clock.ns += perf_counter_ns() - start
            clock.calls += 1

    return _traced(wrapper) if trace.enabled else wrapper  # type: ignore[return-value]


def _traced(method: F) -> F:
    entry, leave = f"{method.__name__}>", f"{method.__name__}<"

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        trace.mark(entry)
        try:
            return method(*args, **kwargs)
        finally:
            trace.mark(leave)

    return wrapper  # type: ignore[return-value]


def flush(clock: HookClock, stats: StatsRecorder, half: Literal["scheduler", "worker"]) -> None:
    """Move the clock's totals into ``stats`` before vLLM takes them. Hook time alone waits
    until there is ``FLUSH_NS`` of it, so idle decode steps do not each send stats."""
    if clock.ns >= FLUSH_NS or (clock.ns and stats.has_data()):
        stats.add_hook_time(half, *clock.take())

"""What the plugin counts, as plain data that travels with vLLM's connector stats.

Each connector half records into a ``StatsRecorder``; vLLM collects ``take()`` every step
(``get_kv_connector_stats``), merges the halves and workers (``merge``), logs ``summarize``
and exports the counters to Prometheus (``prom.py``). Only ints, floats and lists of
floats, so the payload serializes across vLLM's processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from time import thread_time_ns
from typing import Any, TypeVar

T = TypeVar("T")

COUNTERS = (
    "lookups",  # scheduler lookups sent to the server
    "lookup_failures",  # lookups the server did not answer in time (counted as misses)
    "lookups_deferred",  # scheduler steps that moved on while a lookup was still out
    "lookup_query_tokens",  # prompt tokens looked up
    "lookup_hit_tokens",  # tokens the server held (chunk-aligned, before the cap)
    "load_chunks",  # chunks copied into KV blocks
    "load_bytes",
    "load_failed_blocks",  # blocks reported to vLLM for recomputation
    "load_in_place_chunks",  # of load_chunks, those read without a lease (read_in_place)
    "load_in_place_retries",  # reads in place a chunk changed under: loaded under a lease
    "load_in_place_late_changes",  # ... found after the forward pass used it: recomputed
    "save_chunks",  # chunks copied out of KV blocks and committed
    "save_bytes",
    "save_skipped_chunks",  # already stored, no room, or the server was unavailable
)
TIMINGS = ("lookup_seconds", "load_seconds", "save_seconds")
# Wall time inside the connector's hooks (``hooks.py``), per half, and the calls timed;
# CPU time of the plugin's own threads (lookups, reservations, commits, async loads).
HOOK_COUNTERS = ("scheduler_hook_ns", "worker_hook_ns", "hook_calls", "background_cpu_ns")


class StatsRecorder:
    """Thread-safe accumulation between two ``take`` calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                self._data[name] += value

    def add_hook_time(self, half: str, ns: int, calls: int) -> None:
        """``half``: "scheduler" or "worker"."""
        with self._lock:
            self._data[f"{half}_hook_ns"] += ns
            self._data["hook_calls"] += calls

    def cpu_timed(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on this (plugin) thread; its CPU time counts as ``background_cpu_ns``."""
        start = thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            self.add(background_cpu_ns=thread_time_ns() - start)

    def time(self, name: str, seconds: float) -> None:
        with self._lock:
            self._data[name].append(seconds)

    def has_data(self) -> bool:
        with self._lock:
            return not is_empty(self._data)

    def take(self) -> dict[str, Any] | None:
        """The data since the last take, or None if nothing happened."""
        with self._lock:
            data, self._data = self._data, empty()
        return None if is_empty(data) else data


class FirstTokenHold:
    """Keeps the stats off a step that computes first tokens.

    vLLM carries a connector's stats from the worker through the engine core and records
    them (``KVConnectorLogging``, Prometheus) before the step's outputs reach the caller
    (``LLMEngine.step``), so stats handed over on the step that starts a request delay its
    first token: a hit's step always has some (its lookup, its load). Such a step hands
    nothing over and the next step hands over both. Never two steps in a row: on an engine
    whose every step starts requests (prefill-only), the stats still go every other step.
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held = False

    def take(self, stats: StatsRecorder, starts_requests: bool) -> dict[str, Any] | None:
        """``stats.take()``, or None (kept for the next step) on a step that starts
        requests, unless the step before held them back already."""
        if starts_requests and not self._held and stats.has_data():
            self._held = True
            return None
        self._held = False
        return stats.take()


def empty() -> dict[str, Any]:
    data: dict[str, Any] = {name: 0 for name in COUNTERS + HOOK_COUNTERS}
    data.update({name: [] for name in TIMINGS})
    return data


def is_empty(data: dict[str, Any]) -> bool:
    return not any(data.get(n) for n in COUNTERS + HOOK_COUNTERS + TIMINGS)


def merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    for name in COUNTERS + HOOK_COUNTERS:
        into[name] = into.get(name, 0) + other.get(name, 0)
    for name in TIMINGS:
        into[name] = list(into.get(name, [])) + list(other.get(name, []))
    return into


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 1]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))
    return ordered[rank]


def summarize(data: dict[str, Any]) -> dict[str, int | float]:
    """One log line's worth: counts, lookup latency percentiles, copy throughput and the
    time spent inside the hooks."""
    out: dict[str, int | float] = {n: data.get(n, 0) for n in COUNTERS if data.get(n)}
    lookups = data.get("lookup_seconds", [])
    if lookups:
        out["lookup_p50_ms"] = round(percentile(lookups, 0.5) * 1e3, 3)
        out["lookup_p99_ms"] = round(percentile(lookups, 0.99) * 1e3, 3)
    for op in ("load", "save"):
        seconds = sum(data.get(f"{op}_seconds", []))
        if seconds > 0 and data.get(f"{op}_bytes"):
            out[f"{op}_gbps"] = round(data[f"{op}_bytes"] / seconds / 1e9, 3)
    for half in ("scheduler", "worker"):
        if data.get(f"{half}_hook_ns"):
            out[f"{half}_hook_ms"] = round(data[f"{half}_hook_ns"] / 1e6, 3)
    if data.get("hook_calls"):
        out["hook_calls"] = data["hook_calls"]
    if data.get("background_cpu_ns"):
        out["background_cpu_ms"] = round(data["background_cpu_ns"] / 1e6, 3)
    return out

"""The plugin's numbers in vLLM's stats pipeline: the periodic log line and ``/metrics``.

``LMCacheSvcStats`` carries ``stats.py``'s plain data through vLLM (worker -> engine core
-> logger); ``LMCacheSvcPromMetrics`` turns it into ``vllm:lmcache_svc_*`` counters and
histograms next to vLLM's own ``vllm:external_prefix_cache_*`` counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from lmcache_svc_vllm import stats as st

_LATENCY_BUCKETS = [1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0]
_COUNTER_DOCS = {
    "lookups": "Lookups the scheduler sent to lmcache-svc.",
    "lookup_failures": "Lookups lmcache-svc did not answer in time (counted as misses).",
    "lookups_deferred": "Scheduler steps that moved on while a lookup was still out.",
    "lookup_query_tokens": "Prompt tokens (full chunks) looked up in lmcache-svc.",
    "lookup_hit_tokens": "Prompt tokens lmcache-svc held at lookup.",
    "load_chunks": "Chunks loaded from lmcache-svc into KV blocks.",
    "load_bytes": "Bytes loaded from lmcache-svc into KV blocks.",
    "load_failed_blocks": "KV blocks that failed to load and were recomputed.",
    "load_in_place_chunks": "Of the chunks loaded, those read in place without a lease.",
    "load_in_place_retries": "Loads in place a chunk changed under (loaded under a lease).",
    "load_in_place_late_changes": (
        "Loads in place a chunk changed under while it copied beside the forward pass "
        "(its blocks recomputed)."
    ),
    "save_chunks": "Chunks saved from KV blocks to lmcache-svc.",
    "save_bytes": "Bytes saved from KV blocks to lmcache-svc.",
    "save_skipped_chunks": "Chunks not saved: already stored, no room, or server unavailable.",
}
_HOOK_DOCS = {  # counter name -> (stats key, scale, documentation)
    "scheduler_hook_seconds": (
        "scheduler_hook_ns", 1e-9, "Wall time inside the plugin's scheduler-side hooks.",
    ),
    "worker_hook_seconds": (
        "worker_hook_ns", 1e-9, "Wall time inside the plugin's worker-side hooks.",
    ),
    "hook_calls": ("hook_calls", 1, "Connector hook calls timed."),
    "background_cpu_seconds": (
        "background_cpu_ns", 1e-9, "CPU time of the plugin's own threads.",
    ),
}  # fmt: skip
_HISTOGRAM_DOCS = {
    "lookup_seconds": "Scheduler-side lookup latency.",
    "load_seconds": "Time to lease and copy one request's chunks into KV blocks.",
    "save_seconds": "Time one step spent copying chunks out of KV blocks.",
}


@dataclass
class LMCacheSvcStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = st.empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            self.data = st.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return st.summarize(self.data)

    def is_empty(self) -> bool:
        return st.is_empty(self.data)


class LMCacheSvcPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._per_engine(
                self._counter_cls(
                    name=f"vllm:lmcache_svc_{name}", documentation=doc, labelnames=labelnames
                )
            )
            for name, doc in _COUNTER_DOCS.items()
        }
        self._hook_counters = {
            name: (
                key,
                scale,
                self._per_engine(
                    self._counter_cls(
                        name=f"vllm:lmcache_svc_{name}", documentation=doc, labelnames=labelnames
                    )
                ),
            )
            for name, (key, scale, doc) in _HOOK_DOCS.items()
        }
        self._histograms = {
            name: self._per_engine(
                self._histogram_cls(
                    name=f"vllm:lmcache_svc_{name}",
                    documentation=doc,
                    labelnames=labelnames,
                    buckets=_LATENCY_BUCKETS,
                )
            )
            for name, doc in _HISTOGRAM_DOCS.items()
        }

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {i: metric.labels(*v) for i, v in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                per_engine[engine_idx].inc(value)
        for key, scale, per_engine in self._hook_counters.values():
            value = transfer_stats_data.get(key, 0)
            if value:
                per_engine[engine_idx].inc(value * scale)
        for name, per_engine in self._histograms.items():
            for seconds in transfer_stats_data.get(name, []):
                per_engine[engine_idx].observe(seconds)

"""Every Prometheus metric the server exports, defined in one place.

Each server owns a ``Metrics`` with its own registry (no process-global state), so several
servers can live in one test process. Tier state (capacity, used bytes, chunks) is read at
scrape time from the tiers themselves, so the gauges can never drift from the truth.
Names, labels and meanings are documented in ``docs/metrics.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from lmcache_svc.tiers.base import TierStats

if TYPE_CHECKING:
    from lmcache_svc.server.memories.store import MemoryUsage

_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)


class _TierStateCollector(Collector):
    def __init__(self, read_tiers: Callable[[], Iterable[TierStats]]) -> None:
        self._read_tiers = read_tiers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        capacity = GaugeMetricFamily(
            "lmcache_svc_tier_capacity_bytes", "Configured capacity of the tier", labels=["tier"]
        )
        used = GaugeMetricFamily(
            "lmcache_svc_tier_used_bytes", "Bytes held by the tier now", labels=["tier"]
        )
        chunks = GaugeMetricFamily(
            "lmcache_svc_tier_chunks", "Chunks held by the tier now", labels=["tier"]
        )
        for s in self._read_tiers():
            capacity.add_metric([s.name], s.capacity_bytes)
            used.add_metric([s.name], s.used_bytes)
            chunks.add_metric([s.name], s.num_chunks)
        yield from (capacity, used, chunks)


class _MemoryCollector(Collector):
    def __init__(self, read_usage: Callable[[], MemoryUsage]) -> None:
        self._read_usage = read_usage

    def collect(self) -> Iterator[GaugeMetricFamily]:
        usage = self._read_usage()
        yield GaugeMetricFamily(
            "lmcache_svc_memories", "Named memories stored (all tenants)", usage.num_memories
        )
        yield GaugeMetricFamily(
            "lmcache_svc_memory_used_bytes", "Bytes of named memories stored", usage.used_bytes
        )
        yield GaugeMetricFamily(
            "lmcache_svc_memory_capacity_bytes",
            "Configured capacity for named memories (memory.capacity)",
            usage.capacity_bytes,
        )


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.hits = Counter(
            "lmcache_svc_chunk_hits",
            "Chunks found, by the tier that held them",
            ["tier"],
            registry=r,
        )
        self.misses = Counter(
            "lmcache_svc_chunk_misses", "Chunks asked for and found in no tier", registry=r
        )
        self.lookup_chunks = Counter(
            "lmcache_svc_lookup_chunks", "Chunks asked about by lookups", registry=r
        )
        self.lookup_hit_chunks = Counter(
            "lmcache_svc_lookup_hit_chunks",
            "Chunks of lookups' contiguous hit prefixes",
            registry=r,
        )
        self.index_lookups = Counter(
            "lmcache_svc_index_lookups",
            "Lookups clients answered from the shared-memory lookup index, as they report them "
            "(their chunks are counted in lookup_chunks, lookup_hit_chunks, chunk_hits, "
            "chunk_misses too)",
            registry=r,
        )
        self.evictions = Counter(
            "lmcache_svc_evictions",
            "Chunks evicted from a tier (demoted or dropped)",
            ["tier"],
            registry=r,
        )
        self.promotions = Counter(
            "lmcache_svc_promotions",
            "Chunks copied up into a tier from a lower one",
            ["tier"],
            registry=r,
        )
        self.demotions = Counter(
            "lmcache_svc_demotions",
            "Chunks moved down into a tier on eviction",
            ["tier"],
            registry=r,
        )
        self.bytes_read = Counter(
            "lmcache_svc_read_bytes", "Bytes read from a tier", ["tier"], registry=r
        )
        self.bytes_written = Counter(
            "lmcache_svc_written_bytes", "Bytes written to a tier", ["tier"], registry=r
        )
        self.requests = Counter(
            "lmcache_svc_requests", "Requests handled", ["transport", "method", "code"], registry=r
        )
        self.request_latency = Histogram(
            "lmcache_svc_request_latency_seconds",
            "Server-side request latency",
            ["transport", "method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.active_leases = Gauge(
            "lmcache_svc_active_leases", "Load leases currently pinning chunks", registry=r
        )
        self.pending_stores = Gauge(
            "lmcache_svc_pending_stores",
            "Slots reserved by PrepareStore and not yet committed",
            registry=r,
        )
        self.quarantined_bytes = Gauge(
            "lmcache_svc_quarantined_bytes",
            "Bytes of expired reservations kept out of circulation until their writer lets go",
            registry=r,
        )
        self.errors = Counter(
            "lmcache_svc_errors", "Errors by kind (see lmcache_svc/errors.py)", ["kind"], registry=r
        )
        self.tier_errors = Counter(
            "lmcache_svc_tier_errors",
            "Failures of a tier's backend (I/O error, Redis down, corrupted bytes)",
            ["tier", "kind"],
            registry=r,
        )
        self.breaker_state = Gauge(
            "lmcache_svc_tier_breaker_state",
            "Circuit breaker of a lower tier: 0 closed (in use), 1 open (skipped), 2 half-open "
            "(one probe call let through)",
            ["tier"],
            registry=r,
        )
        self.breaker_trips = Counter(
            "lmcache_svc_tier_breaker_trips",
            "Times a lower tier was marked down (a failure, a timeout or a hung call)",
            ["tier"],
            registry=r,
        )
        self.tier_skips = Counter(
            "lmcache_svc_tier_skipped_calls",
            "Calls not made to a lower tier because its breaker was open",
            ["tier", "op"],
            registry=r,
        )
        self.resyncs = Counter(
            "lmcache_svc_tier_resyncs",
            "Index rebuilds of a lower tier after it came back from an outage",
            ["tier"],
            registry=r,
        )
        self.expired = Counter(
            "lmcache_svc_expired",
            "Leases and reservations reclaimed by timeout or disconnect",
            ["what"],
            registry=r,
        )

    def count_index_lookups(
        self, tier: str, num_lookups: int, num_chunks: int, num_hit_chunks: int
    ) -> None:
        """Add lookups a client answered from the lookup index (its hits are all in ``tier``,
        the first) to the counters a ``Lookup`` moves."""
        self.index_lookups.inc(num_lookups)
        self.lookup_chunks.inc(num_chunks)
        self.lookup_hit_chunks.inc(num_hit_chunks)
        self.misses.inc(num_chunks - num_hit_chunks)
        self.hits.labels(tier=tier).inc(num_hit_chunks)

    def watch_tiers(self, read_tiers: Callable[[], Iterable[TierStats]]) -> None:
        """Export capacity, used bytes and chunks of the tiers, read at each scrape."""
        self.registry.register(_TierStateCollector(read_tiers))

    def watch_memories(self, read_usage: Callable[[], MemoryUsage]) -> None:
        """Export the named memories' count, bytes and capacity, read at each scrape."""
        self.registry.register(_MemoryCollector(read_usage))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

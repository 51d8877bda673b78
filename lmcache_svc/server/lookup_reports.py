"""The server's side of ``ReportLookups``: lookups a client answered from the shared-memory
lookup index, checked, then added to the lookup counters (``Metrics.count_index_lookups``).

A report is trusted only as far as it is plausible. The auth interceptor already limits it
to a namespace of the caller's tenant and to a token that may write (a read-only token's
report is ``PERMISSION_DENIED``: the engines that store are the ones whose lookups count).
Here the counts must be non-negative, a hit prefix no longer than the chunks asked, no
lookup longer than ``max_chunks_per_request``, and the tenant must have a table a client
could have read. And each tenant has a budget (``ReportBudget``): at most ``LOOKUPS_PER_S``
lookups and ``CHUNKS_PER_S`` chunks a second, up to ``BURST_S`` seconds' worth at once (a
client reports every 5 s), so no tenant can push the counters (floats) to where adding one
no longer moves them (2^53: a century at the budget, per tenant). Anything else is refused
with ``InvalidArgument`` naming the count or the budget, and counted in
``lmcache_svc_lookup_reports_refused_total{reason}`` (``implausible``, ``over_budget``,
``no_index``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from lmcache_svc.cache import TieredCache
from lmcache_svc.errors import InvalidArgument
from lmcache_svc.v1 import cache_pb2 as pb

LOOKUPS_PER_S = 1 << 20
"""Lookups a tenant may report per second (a scheduler answers far fewer)."""
CHUNKS_PER_S = 1 << 24
"""Chunks those lookups may ask about per second (16 per lookup on average at the most)."""
BURST_S = 60.0
"""The budget's depth: a minute's worth may come in one report."""
MAX_REPORTED_LOOKUPS = int(LOOKUPS_PER_S * BURST_S)
"""Lookups one report may carry."""
MAX_REPORTED_CHUNKS = int(CHUNKS_PER_S * BURST_S)


def check_report(request: pb.ReportLookupsRequest, max_chunks_per_request: int) -> None:
    """``InvalidArgument`` naming the first count that cannot be true."""
    counts = {
        "num_lookups": request.num_lookups,
        "num_chunks": request.num_chunks,
        "num_hit_chunks": request.num_hit_chunks,
    }
    for name, value in counts.items():
        if value < 0:
            raise InvalidArgument(f"ReportLookups: {name} is {value}; counts are never negative")
    if request.num_lookups > MAX_REPORTED_LOOKUPS:
        raise InvalidArgument(
            f"ReportLookups: num_lookups {request.num_lookups} is over "
            f"{MAX_REPORTED_LOOKUPS} in one report"
        )
    if request.num_hit_chunks > request.num_chunks:
        raise InvalidArgument(
            f"ReportLookups: num_hit_chunks {request.num_hit_chunks} is more than the "
            f"{request.num_chunks} chunks asked (num_chunks)"
        )
    if request.num_chunks > request.num_lookups * max_chunks_per_request:
        raise InvalidArgument(
            f"ReportLookups: num_chunks {request.num_chunks} in {request.num_lookups} lookups "
            f"is more than max_chunks_per_request ({max_chunks_per_request}) per lookup"
        )


@dataclass(slots=True)
class _Bucket:
    lookups: float
    chunks: float
    at: float


class ReportBudget:
    """Per tenant, what may still be reported: refilled at ``LOOKUPS_PER_S`` and
    ``CHUNKS_PER_S``, at most ``BURST_S`` seconds' worth. Thread-safe. Only tenants with a
    lookup-index table report (at most ``tuning.lookup_index_tenants``), so it stays small."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, _Bucket] = {}

    def take(self, tenant: str, num_lookups: int, num_chunks: int) -> None:
        """Spend a report's counts; ``InvalidArgument`` (nothing spent) over the budget."""
        with self._lock:
            now = self._clock()
            b = self._buckets.get(tenant)
            if b is None:
                b = self._buckets[tenant] = _Bucket(MAX_REPORTED_LOOKUPS, MAX_REPORTED_CHUNKS, now)
            elapsed, b.at = max(0.0, now - b.at), now
            b.lookups = min(MAX_REPORTED_LOOKUPS, b.lookups + elapsed * LOOKUPS_PER_S)
            b.chunks = min(MAX_REPORTED_CHUNKS, b.chunks + elapsed * CHUNKS_PER_S)
            for what, count, left, rate in (
                ("lookups", num_lookups, b.lookups, LOOKUPS_PER_S),
                ("chunks", num_chunks, b.chunks, CHUNKS_PER_S),
            ):
                if count > left:
                    raise InvalidArgument(
                        f"ReportLookups: tenant {tenant!r} reports {count} {what}, but only "
                        f"{int(left)} more fit its budget of {rate} {what} a second (at most "
                        f"{BURST_S:g} s worth at once); the report is refused"
                    )
            b.lookups -= num_lookups
            b.chunks -= num_chunks


def count_report(
    cache: TieredCache, request: pb.ReportLookupsRequest, budget: ReportBudget
) -> None:
    """Check a report, spend it from its tenant's budget, add it to the lookup counters."""
    ns = cache.namespace(request.namespace_id)  # UnknownNamespace: the client re-registers
    refused = cache.metrics.refused_reports
    index = cache.lookup_index
    if index is None or index.table_of(ns.tenant) is None:
        refused.labels(reason="no_index").inc()
        raise InvalidArgument(
            f"ReportLookups: tenant {ns.tenant!r} has no lookup index on this server, so no "
            "lookup was answered from one; nothing to report"
        )
    try:
        check_report(request, cache.settings.max_chunks_per_request)
    except InvalidArgument:
        refused.labels(reason="implausible").inc()
        raise
    try:
        budget.take(ns.tenant, request.num_lookups, request.num_chunks)
    except InvalidArgument:
        refused.labels(reason="over_budget").inc()
        raise
    cache.metrics.count_index_lookups(
        cache.tiers[0].name, request.num_lookups, request.num_chunks, request.num_hit_chunks
    )

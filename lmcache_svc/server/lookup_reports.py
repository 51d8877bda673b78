"""The server's side of ``ReportLookups``: lookups a client answered from the shared-memory
lookup index, checked, then added to the lookup counters (``Metrics.count_index_lookups``).

A report is trusted only as far as it is plausible: the auth interceptor already limits it
to a namespace of the caller's tenant; here the counts must be non-negative, a hit prefix no
longer than the chunks asked, no lookup longer than ``max_chunks_per_request``, no more than
``MAX_REPORTED_LOOKUPS`` lookups at once, and the tenant must have a table a client could
have read. Anything else is refused with ``InvalidArgument`` naming the count.
"""

from __future__ import annotations

from lmcache_svc.cache import TieredCache
from lmcache_svc.errors import InvalidArgument
from lmcache_svc.v1 import cache_pb2 as pb

MAX_REPORTED_LOOKUPS = 1 << 30
"""Lookups one report may carry (a client reports every few seconds)."""


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


def count_report(cache: TieredCache, request: pb.ReportLookupsRequest) -> None:
    """Check a report and add it to the cache's lookup counters."""
    ns = cache.namespace(request.namespace_id)  # UnknownNamespace: the client re-registers
    index = cache.lookup_index
    if index is None or index.table_of(ns.tenant) is None:
        raise InvalidArgument(
            f"ReportLookups: tenant {ns.tenant!r} has no lookup index on this server, so no "
            "lookup was answered from one; nothing to report"
        )
    check_report(request, cache.settings.max_chunks_per_request)
    cache.metrics.count_index_lookups(
        cache.tiers[0].name, request.num_lookups, request.num_chunks, request.num_hit_chunks
    )

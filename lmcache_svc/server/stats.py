"""The cache's stats as the plain fields both transports answer with (gRPC ``Stats``, REST
``GET /v1/stats``): the field names of ``CacheStats`` and ``TierStats`` are the names of the
proto's ``StatsResponse``/``TierState`` and of the REST ``StatsResponse`` model."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from lmcache_svc.cache import TieredCache


def stats_fields(cache: TieredCache) -> dict[str, Any]:
    """``tiers`` (name, capacity_bytes, used_bytes, num_chunks each), ``active_leases``,
    ``pending_stores``, ``num_namespaces``."""
    return asdict(cache.stats())

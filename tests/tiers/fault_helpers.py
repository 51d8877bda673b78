"""What the fault tests share: server metrics and what a real Redis holds (polling is
``tests.helpers.wait_until``)."""

from __future__ import annotations

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from lmcache_svc.tiers.redis import HEADER
from lmcache_svc_bench.procs import ServerProc

KEY_PREFIX = "lmcache-svc:v1:"


def metric(server: ServerProc, name: str, **labels: str) -> float:
    """One sample of the server's /metrics (0 when absent)."""
    text = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def tier_stats(server: ServerProc, tier: str) -> dict[str, int]:
    stats = httpx.get(f"{server.http_url}/v1/stats", timeout=10).json()
    (found,) = [t for t in stats["tiers"] if t["name"] == tier]
    return {"num_chunks": int(found["num_chunks"]), "used_bytes": int(found["used_bytes"])}


def redis_holds(url: str) -> dict[str, int]:
    """Chunks and payload bytes the real Redis holds under the tier's prefix (SCAN)."""
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        keys = list(client.scan_iter(match=KEY_PREFIX + "*", count=1000))
        sizes = [int(client.strlen(k)) - HEADER.size for k in keys]
    finally:
        client.close()
    return {"num_chunks": len(keys), "used_bytes": sum(sizes)}

"""Our side of the LMCache side-by-side: the calls ``lmcache bench server`` makes, made
through ``CacheClient`` on the same shape (8 MiB chunks, full 256-token chunks of each
request), each timed on its own like LMCache's client times its calls."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from lmcache_svc.client import CacheClient
from lmcache_svc_bench import lmcache_peer as peer
from lmcache_svc_bench.dataplane_paths import (
    Buffers,
    Workload,
    namespace_for,
    time_shm_load,
    time_shm_store,
)
from lmcache_svc_bench.stats import median, percentile


@dataclass(frozen=True, slots=True)
class OursRun:
    num_calls: int
    call_bytes: int
    store_s_p50: float
    load_s_p50: float
    lookup_ms_p50: float
    lookup_ms_p99: float
    empty_lookup_ms_p50: float  # a Lookup of no hashes: the bare gRPC round trip here
    verified: bool
    index_lookup_ms_p50: float | None = None  # from the shm lookup index (the plugin's path)
    index_lookup_ms_p99: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_ours_like_peer(
    client: CacheClient,
    num_tokens: int,
    num_calls: int,
    index_client: CacheClient | None = None,
) -> OursRun:
    """Per request: lookup (a miss), store, lookup (a hit, timed), load; then delete all.
    ``index_client`` (``local_lookup=True``): the hit is also looked up, and timed, in the
    server's shared-memory index, as the plugin's scheduler does (``lookup_local``; a
    lookup the index could not answer is not timed: no index figure when none was)."""
    call_bytes = peer.call_bytes(num_tokens)
    w = Workload(peer.CHUNK_BYTES, call_bytes * num_calls, call_bytes)
    bufs = Buffers(Workload(peer.CHUNK_BYTES, call_bytes, call_bytes))  # one request's pages
    ns_id = client.register_namespace(namespace_for(peer.CHUNK_BYTES))
    requests = w.request_hashes()
    store_s: list[float] = []
    load_s: list[float] = []
    lookup_s: list[float] = []
    empty_s: list[float] = []
    index_s: list[float] = []
    if index_client is not None:
        index_client.register_namespace(namespace_for(peer.CHUNK_BYTES))
        index_client.wait_shm_ready()  # the session (and its lookup index) open now
    verified = True
    try:
        for hashes in requests:
            if client.lookup(ns_id, hashes).num_hit_chunks != 0:
                raise RuntimeError("fresh chunk hashes were found before being stored")
            store_s.append(time_shm_store(client, ns_id, [hashes], bufs))
            start = time.perf_counter()
            hit = client.lookup(ns_id, hashes).num_hit_chunks
            lookup_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            client.lookup(ns_id, [])
            empty_s.append(time.perf_counter() - start)
            if hit != len(hashes):
                raise RuntimeError(f"lookup right after a store hit {hit} of {len(hashes)}")
            if index_client is not None:  # timed only when the index answered
                start = time.perf_counter()
                local = index_client.lookup_local(ns_id, hashes)
                elapsed = time.perf_counter() - start
                if local is not None:
                    index_s.append(elapsed)
                    if local.num_hit_chunks != len(hashes):
                        hit = local.num_hit_chunks
                        raise RuntimeError(f"index lookup after a store hit {hit}/{len(hashes)}")
            bufs.clear_dst()
            load_s.append(time_shm_load(client, ns_id, [hashes], bufs))
            verified = verified and bufs.verified()
    finally:
        client.delete(ns_id, [h for hashes in requests for h in hashes])
    return OursRun(
        num_calls=len(requests),
        call_bytes=call_bytes,
        store_s_p50=median(store_s),
        load_s_p50=median(load_s),
        lookup_ms_p50=median(lookup_s) * 1e3,
        lookup_ms_p99=percentile(lookup_s, 99) * 1e3,
        empty_lookup_ms_p50=median(empty_s) * 1e3,
        verified=verified,
        index_lookup_ms_p50=median(index_s) * 1e3 if index_s else None,
        index_lookup_ms_p99=percentile(index_s, 99) * 1e3 if index_s else None,
    )

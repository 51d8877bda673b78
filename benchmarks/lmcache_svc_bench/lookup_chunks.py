"""``bench lookup``'s chunk-size table: one 32k-token prompt at the chunk sizes an engine runs.

The vLLM plugin's chunk size decides how many items every request carries: one chunk hash
per chunk in the scheduler's lookup (and one slot per chunk in each store and load). Here
the same 32k-token full-hit prompt is looked up as 128 chunks of 256 tokens, 256 of 128
(the plugin's default on vLLM's CPU backend and on CUDA) and 2,048 of 16 (vLLM's CUDA
block), against the index ``bench lookup`` built: server-side (``TieredCache.lookup``), the
round trip over the Unix socket, and the plugin's own hashing of the prompt's chunk keys
(``keys.chunk_hashes``, which the scheduler runs once per rank for every new request).
"""

from __future__ import annotations

from dataclasses import dataclass

from lmcache_svc.cache import TieredCache
from lmcache_svc.client import CacheClient
from lmcache_svc.keys import KVLayout, Namespace, chunk_hashes
from lmcache_svc_bench.lookup import Latency, synthetic_hash, time_calls
from lmcache_svc_bench.report import Report

PROMPT_TOKENS = 32768
CHUNK_SIZES = (256, 128, 16)
# A Llama-3.1-8B-like layout (only the chunk size and block size matter to hashing cost).
_LAYOUT = KVLayout("bfloat16", 32, 8, 128, 16, "bench/hashing")


@dataclass(frozen=True, slots=True)
class ChunkSizeCost:
    chunk_size: int
    num_chunks: int
    server: Latency
    socket: Latency
    hashing: Latency


def measure_chunk_sizes(
    cache: TieredCache, client: CacheClient, ns_id: bytes, num_indexed: int, iters: int
) -> list[ChunkSizeCost]:
    """A full-hit lookup of the prompt at each chunk size whose chunks fit in the index."""
    tokens = list(range(PROMPT_TOKENS))
    sizes = [c for c in CHUNK_SIZES if PROMPT_TOKENS // c <= num_indexed]
    return [_measure(cache, client, ns_id, tokens, c, iters) for c in sizes]


def _measure(
    cache: TieredCache,
    client: CacheClient,
    ns_id: bytes,
    tokens: list[int],
    chunk_size: int,
    iters: int,
) -> ChunkSizeCost:
    n = len(tokens) // chunk_size
    hashes = [synthetic_hash(i) for i in range(n)]
    for got in (cache.lookup(ns_id, hashes), client.lookup(ns_id, hashes)):
        if got.num_hit_chunks != n:
            raise RuntimeError(f"{n}-chunk prompt: {got.num_hit_chunks} hits, expected {n}")
    ns = Namespace(model="bench-hashing", layout=_LAYOUT, chunk_size=chunk_size)
    return ChunkSizeCost(
        chunk_size,
        n,
        time_calls(lambda: cache.lookup(ns_id, hashes), iters),
        time_calls(lambda: client.lookup(ns_id, hashes), iters),
        time_calls(lambda: chunk_hashes(ns, tokens), max(20, iters // 20)),
    )


def add_chunk_size_table(report: Report, costs: list[ChunkSizeCost], num_indexed: int) -> None:
    table = report.table(
        f"Lookup of a {PROMPT_TOKENS // 1024}k-token prompt by chunk size "
        f"({num_indexed:,} chunks indexed)",
        [
            "chunk tokens",
            "chunks per prompt",
            "server-side p50 ms",
            "p99 ms",
            "unix socket p50 ms",
            "p99 ms",
            "hashing p50 ms",
        ],
    )
    for c in costs:
        table.add(
            c.chunk_size,
            c.num_chunks,
            c.server.p50_ms,
            c.server.p99_ms,
            c.socket.p50_ms,
            c.socket.p99_ms,
            c.hashing.p50_ms,
        )
    table.notes.append(
        "full hit; hashing: keys.chunk_hashes of the prompt's token ids in this process (the "
        "plugin's scheduler does it once per tensor-parallel rank per new request); the "
        "server's index costs the same bytes per chunk whatever the chunk's size (bench scale)"
    )
    report.data["chunk_sizes"] = [
        {
            "chunk_size": c.chunk_size,
            "num_chunks": c.num_chunks,
            "server_p50_ms": c.server.p50_ms,
            "socket_p50_ms": c.socket.p50_ms,
            "hashing_p50_ms": c.hashing.p50_ms,
        }
        for c in costs
    ]

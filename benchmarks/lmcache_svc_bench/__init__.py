"""``lmcache-svc bench NAME``: benchmarks that print every figure next to its baseline.

Each benchmark is a module here with ``run(ctx: BenchContext) -> Report``; ``runner.py``
creates the context, times the run and writes the report. ``--quick`` shrinks every
benchmark to about two minutes on a 2-core machine (CI runs it as a smoke test that
asserts no timing); the default is the full mode whose results go in docs/benchmarks.md.

A distribution of its own (``benchmarks/pyproject.toml``), outside the runtime package: the
server image and the client wheel do not hold it. The process drivers here (``procs``,
``redis_procs``, ``vllm.engines``) are shared with the tests.
"""

from __future__ import annotations

# name -> (module, one-line description)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "ttft": (
        "lmcache_svc_bench.ttft",
        "time to first token on real vLLM: prompt only, lmcache-svc hit, vLLM prefix hit, "
        "ExampleConnector hit (MemOS matrix)",
    ),
    "hitcost": (
        "lmcache_svc_bench.hitcost",
        "a hit's fixed cost in pairs: vLLM's own prefix hit, with a no-op connector, with "
        "the plugin, and loaded from the server, the engines up at once and alternating",
    ),
    "dataplane": (
        "lmcache_svc_bench.dataplane",
        "store/load through shared memory, inline gRPC and REST vs a torch copy; "
        "side by side with LMCache's server",
    ),
    "tiers": (
        "lmcache_svc_bench.tiers",
        "SSD tier vs dd O_DIRECT; Redis tier vs redis-benchmark and a naive redis-py loop",
    ),
    "lookup": (
        "lmcache_svc_bench.lookup",
        "batched lookup p50/p99 (128 chunks) with 10^5 and 10^6 chunks indexed",
    ),
    "overhead": (
        "lmcache_svc_bench.overhead",
        "vLLM throughput with the plugin and nothing ever hitting vs no plugin",
    ),
    "soak": (
        "lmcache_svc_bench.soak",
        "clients storing, loading and looking up chunks and named memories through client "
        "kills, a hung and a restarted Redis, server restarts and memory files corrupted on "
        "disk; every loaded byte verified",
    ),
    "memory": (
        "lmcache_svc_bench.memory",
        "MemOS's KVCacheMemory matrix on a local transformers model: TTFT with a memory "
        "fetched from the service vs as prompt text",
    ),
    "scale": (
        "lmcache_svc_bench.scale",
        "server memory per indexed chunk; load time vs prefix length; lookup vs index size",
    ),
    "routing": (
        "lmcache_svc_bench.routing",
        "two engines with a sidecar each (optionally one Redis Cluster behind both), the "
        "workload routed round robin vs by the KV events through Dynamo's indexer; the "
        "events' cost on the store path",
    ),
    "workload": (
        "lmcache_svc_bench.workload",
        "many users in multi-turn conversations against vllm serve, driven by vllm bench "
        "serve: plain vLLM vs vLLM + lmcache-svc (arena; arena + SSD)",
    ),
}

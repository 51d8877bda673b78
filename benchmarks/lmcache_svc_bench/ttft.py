"""``bench ttft``: time to first token on real vLLM (CPU), MemOS-style matrix.

Background contexts of about 583, 2,773 and 6,064 tokens times queries of about 167, 303
and 953 tokens (MemOS's KVCacheMemory evaluation), random token ids, a random-weight Llama
(``bench_model.MEDIUM``: 8 layers, hidden 1024, 32 KiB of KV per token). Four strategies
(``vllm_ttft.py``): (a) prompt only, (b) lmcache-svc hit in a fresh engine with the plugin's
defaults (no chunk settings), (c) vLLM's own prefix-cache hit in the same engine, (d) vLLM's
ExampleConnector hit in a fresh engine. The targets are evaluated on (b).

TTFT is timed inside the engine process, per request, as a streaming client sees it: from
``LLMEngine.add_request`` to the first ``step()`` that returns a generated token (the
request then goes on to ``max_tokens`` greedy tokens, which must be identical across the
strategies). Each cell has several queries (different random tokens of the same length, so
(c) never hits the query itself); the table gives the median per cell.

``--set`` keys: ``model`` (tiny|medium), ``contexts`` / ``queries`` (comma-separated token
counts), ``num_queries`` (9 by default, 2 in ``--quick``: with 3 a cell's median moved
by up to 0.2x between runs on one host), ``max_tokens``, ``chunk_size`` (configure (b)'s
plugin with it; default: unset, so the plugin derives it from the block size),
``strategies`` (of a,b,b256,bl,bp,c,d; b256 is (b) with ``chunk_size: 256``, the plugin's
default before it was derived from the block size; bl is (b) with ``read_in_place: false``,
every load under a lease, the plugin's default before loads were read in place; bp is (b)
with a store pool of 64 slots, ``tuning.store_pool_chunks``: no reservation call in a
step), ``seed``,
``engine_rounds`` (3 by default, 1 in ``--quick``).

The engines of the strategies are up at once and take each query in a rotating order, one
request at a time, each idle a moment before it, in rounds of fresh engines started in a
rotated order (``vllm/rounds.py``, as ``bench hitcost``). Run one engine after another, the
same request's TTFT drifted by several milliseconds between engines on a 2-vCPU host, more
than the fixed cost of a hit that the targets weigh.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from lmcache_svc_bench.procs import start_server
from lmcache_svc_bench.report import Report
from lmcache_svc_bench.runner import BenchContext
from lmcache_svc_bench.vllm.engines import example_connector_config
from lmcache_svc_bench.vllm.rounds import check_rounds
from lmcache_svc_bench.vllm_common import (
    MAX_MODEL_LEN,
    kv_bytes_per_token,
    make_model,
    random_tokens,
    require_vllm,
    shape_named,
    wait_for_commits,
)
from lmcache_svc_bench.vllm_ttft import (
    PLUGIN_DEFAULT_CHUNK,
    Measured,
    Setup,
    Strategy,
    Workload,
    measure_side_by_side,
    plugin_config,
    write_contexts,
)
from lmcache_svc_bench.vllm_ttft_breakdown import memcpy_gbps
from lmcache_svc_bench.vllm_ttft_report import write_report

STRATEGIES = ("a", "b", "b256", "bl", "bp", "c", "d")
QUICK_STRATEGIES = FULL = "a,b,c,d"
EXPLICIT_CHUNKS = {"b256": 256}  # strategies that configure a chunk size of their own
# Other settings of a (b) variant; each variant its own tenant, so it never hits what another
# variant's engine stored (the queries, saved after their first token).
PLUGIN_SETTINGS: dict[str, dict[str, object]] = {
    "bl": {"read_in_place": False, "tenant": "bl"},
    "bp": {"tuning": {"store_pool_chunks": 64}, "tenant": "bp"},
}


@dataclass(frozen=True)
class Params:
    model: str
    contexts: tuple[int, ...]
    queries: tuple[int, ...]
    num_queries: int
    max_tokens: int
    chunk_size: int | None  # None: the plugin's default
    strategies: tuple[str, ...]
    seed: int
    engine_rounds: int = 1

    def check(self) -> None:
        shape_named(self.model)
        unknown = set(self.strategies) - set(STRATEGIES)
        if unknown or "a" not in self.strategies:
            raise ValueError(
                f"strategies must include a and be of {','.join(STRATEGIES)}, "
                f"got {','.join(self.strategies)}"
            )
        longest = max(self.contexts) + max(self.queries) + self.max_tokens
        if longest > MAX_MODEL_LEN:
            raise ValueError(f"longest prompt {longest} tokens > max_model_len {MAX_MODEL_LEN}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")
        if min(self.contexts + self.queries) < 1 or self.num_queries < 1 or self.max_tokens < 1:
            raise ValueError("contexts, queries, num_queries and max_tokens must be positive")
        check_rounds(self.engine_rounds, self.num_queries)


def params(ctx: BenchContext) -> Params:
    quick = ctx.quick
    p = Params(
        model=ctx.option("model", "tiny" if quick else "medium"),
        contexts=_ints(ctx.option("contexts", "2773" if quick else "583,2773,6064")),
        queries=_ints(ctx.option("queries", "167,953" if quick else "167,303,953")),
        num_queries=ctx.option("num_queries", 2 if quick else 9),
        max_tokens=ctx.option("max_tokens", 8),
        chunk_size=_optional_int(ctx.option("chunk_size", None)),
        strategies=tuple(ctx.option("strategies", QUICK_STRATEGIES if quick else FULL).split(",")),
        seed=ctx.option("seed", 0),
        engine_rounds=ctx.option("engine_rounds", 1 if quick else 3),
    )
    p.check()
    return p


def _optional_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"chunk_size must be an integer, got {text!r}") from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated token counts, got {text!r}") from None


def make_workload(p: Params) -> Workload:
    rng = random.Random(p.seed)
    contexts = {n: random_tokens(rng, n) for n in p.contexts}
    queries = {
        (c, q): [random_tokens(rng, q) for _ in range(p.num_queries)]
        for c in p.contexts
        for q in p.queries
    }
    warmup = random_tokens(rng, max(p.contexts) + max(p.queries))
    # drawn last: the cells' tokens stay those of the same seed before the warm-up hit came
    warm_context = random_tokens(rng, max(p.contexts))
    warm_queries = [random_tokens(rng, min(p.queries)) for _ in range(p.num_queries)]
    return Workload(contexts, queries, warmup, p.max_tokens, warm_context, warm_queries)


def run(ctx: BenchContext) -> Report:
    require_vllm()
    p = params(ctx)
    workload = make_workload(p)
    shape = shape_named(p.model)
    ctx.progress(
        f"model {p.model} ({shape.num_layers} layers, hidden {shape.hidden}, "
        f"{kv_bytes_per_token(shape) // 1024} KiB KV/token); {len(workload.queries)} cells x "
        f"{p.num_queries} queries; strategies {','.join(p.strategies)}"
    )
    model_dir = make_model(ctx.work_dir, p.model)
    server_bytes = "256MiB" if p.model == "tiny" else "3GiB"
    server = start_server(ctx.work_dir, "--cpu-bytes", server_bytes, "--prefault", "sync")
    try:
        setup = Setup(model_dir, ctx.work_dir, server.socket, p.chunk_size, ctx.progress)
        measured = _run_strategies(setup, workload, p, ctx.work_dir / "example-kv")
    finally:
        server.cleanup()
    report = ctx.report()
    gbps = memcpy_gbps()
    write_report(
        report,
        p,
        measured.results,
        ctx.out_dir,
        kv_bytes_per_token=kv_bytes_per_token(shape),
        gbps=gbps,
        first_hits=measured.first_hits,
    )
    return report


def _run_strategies(setup: Setup, workload: Workload, p: Params, storage_dir: Path) -> Measured:
    """The writers of (b) and (d) first (one at a time), then every strategy's engine side
    by side (``measure_side_by_side``)."""
    strategies: list[Strategy] = []
    num_chunks = 0
    try:
        for name in p.strategies:
            if name == "a":
                strategies.append(Strategy(name))
            elif name == "c":
                strategies.append(Strategy(name, prefix_caching=True, contexts_first=True))
            elif name == "d":
                storage_dir.mkdir(parents=True, exist_ok=True)
                config = example_connector_config(storage_dir)
                write_contexts(setup, workload, name, config)
                strategies.append(Strategy(name, config))
            else:
                chunk_size = EXPLICIT_CHUNKS.get(name, p.chunk_size)
                config = plugin_config(setup, chunk_size, **PLUGIN_SETTINGS.get(name, {}))
                write_contexts(setup, workload, name, config)
                chunk = PLUGIN_DEFAULT_CHUNK if chunk_size is None else chunk_size
                num_chunks += sum(len(c) // chunk for c in workload.stored_contexts())
                strategies.append(Strategy(name, config))
        held = wait_for_commits(setup.server_socket, num_chunks)
        setup.progress(f"the server holds {held} chunks (the contexts alone: {num_chunks})")
        return measure_side_by_side(setup, workload, strategies, p.engine_rounds)
    finally:
        shutil.rmtree(storage_dir, ignore_errors=True)

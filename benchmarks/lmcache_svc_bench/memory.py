"""``bench memory``: MemOS's KVCacheMemory evaluation with memories kept in the service.

MemOS's matrix (contexts of 583, 2,773 and 6,064 tokens x queries of 167, 303 and 953) on a
local random-weight transformers Llama (float32, on this CPU; built with
``lmcache_svc.kv_memory.tiny_model``, nothing downloaded). For each cell, with a real
``lmcache-svc serve`` holding the memories:

- build: ``extract`` (one forward pass over the context) and ``add`` (put into the service);
- TTFT with the memory as prompt text: one forward pass over context + query, first token;
- TTFT with the memory injected: ``get_cache`` (fetched from the service over gRPC and
  decoded, timed) plus the forward pass over the query only with the cache, first token;
- speedup (prompt / injected) next to MemOS's published one (Qwen3-8B on a GPU);
- whether greedy output (``max_tokens`` tokens) is identical on both paths, and the first
  token's top-2 logit margin;
- the fetch alone: ``CacheClient.get_memory`` of the blob vs an in-process copy of the same
  bytes, and the blob's decode into a ``DynamicCache``.

Medians of ``reps`` runs per figure; each run uses a fresh copy of the cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from lmcache_svc_bench.procs import start_server
from lmcache_svc_bench.report import Report
from lmcache_svc_bench.runner import BenchContext
from lmcache_svc_bench.stats import median, ms
from lmcache_svc_bench.vllm_ttft_report import memos_speedup


@dataclass(frozen=True)
class Params:
    contexts: tuple[int, ...]
    queries: tuple[int, ...]
    reps: int
    max_tokens: int
    hidden: int
    layers: int


def params(ctx: BenchContext) -> Params:
    return Params(
        contexts=_ints(ctx.option("contexts", "583,2773" if ctx.quick else "583,2773,6064")),
        queries=_ints(ctx.option("queries", "167" if ctx.quick else "167,303,953")),
        reps=ctx.option("reps", 1 if ctx.quick else 3),
        max_tokens=ctx.option("max_tokens", 8),
        hidden=ctx.option("hidden", 256),
        layers=ctx.option("layers", 4),
    )


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in str(text).split(",") if x)


@dataclass
class Cell:
    context: int
    query: int
    build_s: float
    add_s: float
    ttft_prompt_s: float
    ttft_injected_s: float
    fetch_s: float
    identical: bool
    margin: float


def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = call()
    return time.perf_counter() - t0, out


def require_memory_extra() -> None:
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "bench memory needs the memory extra (transformers, safetensors): "
            "pip install '.[memory]' (scripts/setup.sh --dev installs it)"
        ) from None


def run(ctx: BenchContext) -> Report:
    require_memory_extra()
    from lmcache_svc.kv_memory import KVCacheMemory, KVCacheMemoryConfig
    from lmcache_svc.kv_memory.tiny_model import TinySpec, build_tiny_llama

    p = params(ctx)
    spec = TinySpec(
        num_words=4000,
        hidden_size=p.hidden,
        num_layers=p.layers,
        num_heads=p.hidden // 64,
        num_kv_heads=max(1, p.hidden // 128),
        intermediate_size=p.hidden * 11 // 4,
        initializer_range=0.05,
    )
    model_dir = build_tiny_llama(ctx.work_dir / "model", spec)
    server = start_server(ctx.work_dir, "--memory-bytes", "4GiB")
    try:
        config = KVCacheMemoryConfig(
            extractor_llm={
                "backend": "huggingface",
                "config": {"model_name_or_path": str(model_dir)},
            },
            service_address=server.socket,
        )
        mem = KVCacheMemory(config)
        ctx.progress(f"model {mem.llm.identity}: {p.layers} layers, hidden {p.hidden}, float32")
        cells = [_cell(ctx, mem, p, c, q) for c in p.contexts for q in p.queries]
        fetches = [_fetch(mem, c, p.reps) for c in p.contexts]
    finally:
        server.stop()
        server.cleanup()
    return _report(ctx, p, spec, cells, fetches)


def _cell(ctx: BenchContext, mem: Any, p: Params, context: int, query: int) -> Cell:
    from lmcache_svc.kv_memory.tiny_model import sample_text

    text = sample_text(context - 1, seed=context, vocab_words=4000)  # + BOS = context tokens
    q = sample_text(query, seed=context + query, vocab_words=4000)
    builds, adds, prompts, injected, fetches = [], [], [], [], []
    item = mem.extract(text)  # warm-up (allocator, kernels), untimed
    for _ in range(p.reps):
        build_s, item = _timed(lambda: mem.extract(text))
        builds.append(build_s)
        adds.append(_timed(partial(mem.add, [item]))[0])
    ids = mem.prompt_ids(q, [item.id])
    assert len(ids) == context + query, (len(ids), context, query)
    mem.llm.generate(ids, mem.get_cache([item.id]), 1)  # warm-up, untimed
    for _ in range(p.reps):
        prompts.append(_timed(lambda: mem.llm.generate(ids, None, 1))[0])
        fetch_s, cache = _timed(lambda: mem.get_cache([item.id]))
        injected.append(fetch_s + _timed(partial(mem.llm.generate, ids, cache, 1))[0])
        fetches.append(fetch_s)
    full = mem.llm.generate(ids, None, p.max_tokens)
    with_cache = mem.llm.generate(ids, mem.get_cache([item.id]), p.max_tokens)
    top = full.first_logits.topk(2).values
    mem.delete([item.id])
    cell = Cell(
        context, query, median(builds), median(adds), median(prompts), median(injected),
        median(fetches), full.token_ids == with_cache.token_ids, float(top[0] - top[1]),
    )  # fmt: skip
    ctx.progress(
        f"ctx {context} q {query}: prompt {ms(cell.ttft_prompt_s):.0f} ms, injected "
        f"{ms(cell.ttft_injected_s):.0f} ms (fetch {ms(cell.fetch_s):.0f}), "
        f"identical {cell.identical}"
    )
    return cell


@dataclass
class Fetch:
    context: int
    size_bytes: int
    service_s: float
    copy_s: float
    decode_s: float


def _fetch(mem: Any, context: int, reps: int) -> Fetch:
    from lmcache_svc.kv_memory.blob import item_from_blob
    from lmcache_svc.kv_memory.tiny_model import sample_text

    item = mem.extract(sample_text(context - 1, seed=context, vocab_words=4000))
    mem.add([item])
    blob = mem.backend.get_memory(item.id)
    service = [_timed(lambda: mem.backend.get_memory(item.id))[0] for _ in range(reps * 3)]
    copies = [_timed(lambda: bytearray(blob))[0] for _ in range(reps * 3)]
    decodes = [_timed(lambda: item_from_blob(blob))[0] for _ in range(reps * 3)]
    mem.delete([item.id])
    return Fetch(context, len(blob), median(service), median(copies), median(decodes))


def _report(
    ctx: BenchContext, p: Params, spec: Any, cells: list[Cell], fetches: list[Fetch]
) -> Report:
    report = ctx.report()
    table = report.table(
        "TTFT: memory injected (fetched from the service) vs memory as prompt text",
        ["context", "query", "build ms", "add ms", "prompt TTFT ms", "injected TTFT ms",
         "of which fetch ms", "speedup", "MemOS speedup (Qwen3-8B)", "identical output",
         "top-2 margin"],
    )  # fmt: skip
    for c in cells:
        memos = memos_speedup((c.context, c.query))
        table.add(
            c.context, c.query, ms(c.build_s), ms(c.add_s), ms(c.ttft_prompt_s),
            ms(c.ttft_injected_s), ms(c.fetch_s), c.ttft_prompt_s / c.ttft_injected_s,
            memos if memos is not None else "-", "yes" if c.identical else "NO", c.margin,
        )  # fmt: skip
    table.notes += [
        f"Random-weight Llama, float32, {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"{spec.num_kv_heads} KV heads of {spec.hidden_size // spec.num_heads}, on this CPU "
        f"(torch threads: default). Medians of {p.reps} runs.",
        "build = extract (one forward pass over the context); add = put into the service.",
        "injected TTFT = get_cache (gRPC fetch + decode into a DynamicCache) + forward pass "
        "over the query with it; prompt TTFT = forward pass over context + query.",
        "MemOS speedup: 1 / (1 - TTFT reduction) from MemOS's KVCacheMemory table (Qwen3-8B, "
        "GPU); ours runs a small model on 2 CPU cores, so the ratio of attention to the rest "
        "differs.",
        f"identical output: the same {p.max_tokens} greedy tokens on both paths.",
    ]
    fetch = report.table(
        "Fetching a memory: from the service vs an in-process copy of the same bytes",
        ["context", "blob MB", "service get_memory ms", "in-process copy ms", "decode ms",
         "service GB/s"],
    )  # fmt: skip
    for f in fetches:
        fetch.add(
            f.context, f.size_bytes / 1e6, ms(f.service_s), ms(f.copy_s), ms(f.decode_s),
            f.size_bytes / f.service_s / 1e9,
        )  # fmt: skip
    fetch.notes.append(
        "service get_memory: CacheClient over the Unix socket (gRPC stream of pieces); "
        "in-process copy: bytearray(blob); decode: safetensors -> DynamicCache."
    )
    report.data = {"params": p.__dict__, "cells": [c.__dict__ for c in cells],
                   "fetches": [f.__dict__ for f in fetches]}  # fmt: skip
    return report

"""The four ways of serving "context + query" that ``bench ttft`` compares, one engine each.

Every strategy gets the same prompts and returns one ``Sample`` per (cell, query). The
engines are up at once and take each query in turn, one request at a time (never two
computing at once), in rounds of fresh engines (``vllm/rounds.py``), each with the same
block size, batch limit, KV space and core reservation (``vllm_common.start_engine``).
Before its queries each engine takes a miss and its first hit (``_warm``).

  a   prompt only: vLLM's prefix cache off, every prompt computed in full
  b   lmcache-svc: a writer engine (plugin on) computes each context and stores it into the
      server; a fresh measuring engine (plugin on, vLLM's prefix cache off, so every
      request's context comes from the server) serves context + query. The plugin runs
      with its defaults (no chunk settings: the chunk is derived from the block size)
  c   vLLM's own prefix cache in the same engine: the context is run once, then each
      context + query hits it (the in-engine upper bound)
  d   vLLM's ExampleConnector (safetensors files): a writer engine stores each context's
      files; a fresh engine (prefix cache off) loads them (``example_prefix.py``: the
      stock connector's files and load path, with a prefix lookup)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcache_svc_bench.vllm.engines import EngineProc, kv_transfer_config
from lmcache_svc_bench.vllm.rounds import IDLE_S, check_rounds, rotated, round_queries
from lmcache_svc_bench.vllm_common import BLOCK_SIZE, start_engine

Cell = tuple[int, int]  # (context tokens, query tokens)
# The plugin's default chunk for the benchmarks' block size: the smallest multiple of the
# block size of at least 128 tokens (``default_chunk_size`` in the plugin's config.py; a
# test in tests/vllm checks the two agree).
PLUGIN_DEFAULT_CHUNK = -(-128 // BLOCK_SIZE) * BLOCK_SIZE


@dataclass(frozen=True)
class Workload:
    contexts: dict[int, list[int]]  # context length -> tokens
    queries: dict[Cell, list[list[int]]]  # cell -> its queries
    warmup: list[int]  # an unrelated prompt as long as the longest one: a miss
    max_tokens: int
    warm_context: list[int] = field(default_factory=list)
    """Unrelated to the cells: stored and computed first like their contexts, so that
    ``warm_hit`` is every engine's first hit, before the measured queries (``_warm``)."""
    warm_queries: list[list[int]] = field(default_factory=list)
    """One per round at least: a round's engines store its warm-up hit whole, which would
    cover the next round's hit beyond the context."""

    def prompts(self, cell: Cell) -> list[list[int]]:
        return [self.contexts[cell[0]] + q for q in self.queries[cell]]

    def stored_contexts(self) -> list[list[int]]:
        """What the writers store and (c) computes before its queries: the cells' contexts,
        and the warm-up hit's."""
        warm = [self.warm_context] if self.warm_context else []
        return [*self.contexts.values(), *warm]

    def warm_hit(self, r: int) -> list[int] | None:
        """Round ``r``'s warm-up hit: the warm-up context and a query of that round's own."""
        if not self.warm_context or not self.warm_queries:
            return None
        return self.warm_context + self.warm_queries[r % len(self.warm_queries)]


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    token_ids: list[int]
    num_cached_tokens: int
    marks: list[tuple[float, str]] = field(default_factory=list)  # (ms, name): trace.py


Results = dict[Cell, list[Sample]]


@dataclass(frozen=True)
class Setup:
    model_dir: Path
    log_dir: Path
    server_socket: str
    chunk_size: int | None  # (b)'s configured chunk size; None: the plugin's default
    progress: Callable[[str], None]


@dataclass(frozen=True)
class Strategy:
    """One engine of the comparison: its KV transfer config, whether vLLM's prefix cache
    is on, and whether it computes the contexts itself before its queries ((c))."""

    name: str
    kv_config: dict[str, Any] | None = None
    prefix_caching: bool = False
    contexts_first: bool = False


@dataclass(frozen=True)
class Measured:
    results: dict[str, Results]  # strategy name -> its samples, by cell
    first_hits: dict[str, list[Sample]]  # strategy name -> its engines' warm-up hits


WhileUp = Callable[[dict[str, EngineProc], dict[str, Results]], None]
"""Called after the last round's queries, its engines still up and idle: the engines by
strategy name and the results so far."""


def measure_side_by_side(
    setup: Setup,
    workload: Workload,
    strategies: Sequence[Strategy],
    rounds: int,
    *,
    while_up: WhileUp | None = None,
) -> Measured:
    """Every strategy's engine up at once, each query run on every engine in a rotating
    order (each engine idle ``IDLE_S`` before it), in ``rounds`` of fresh engines started
    in a rotated order (``vllm/rounds.py``). The contexts of (b) and (d) must be written.
    ``while_up``: a last measurement beside the engines (``WhileUp``)."""
    names = [s.name for s in strategies]
    by_name = {s.name: s for s in strategies}
    check_rounds(rounds, min(len(q) for q in workload.queries.values()))
    results: dict[str, Results] = {name: {cell: [] for cell in workload.queries} for name in names}
    first_hits: dict[str, list[Sample]] = {name: [] for name in names}
    for r in range(rounds):
        engines: dict[str, EngineProc] = {}
        try:
            for name in rotated(names, r):
                s = by_name[name]
                engines[name] = _start(
                    setup, f"{name}-{r}", kv_config=s.kv_config, prefix_caching=s.prefix_caching
                )
            for name, sample in _warm(engines, by_name, workload.warm_hit(r), workload).items():
                first_hits[name].append(sample)
            for cell in workload.queries:
                prompts = workload.prompts(cell)
                for i in round_queries(r, rounds, len(prompts)):
                    for name in rotated(names, i):
                        time.sleep(IDLE_S)
                        out = engines[name].ttft(prompts[i], workload.max_tokens)
                        results[name][cell].append(_sample(out))
                _progress(setup, results, cell, f"round {r + 1} of {rounds}")
            if while_up is not None and r == rounds - 1:
                while_up(engines, results)
        finally:
            for engine in engines.values():
                engine.close()
    return Measured(results, first_hits)


def _warm(
    engines: dict[str, EngineProc],
    strategies: dict[str, Strategy],
    hit: list[int] | None,
    workload: Workload,
) -> dict[str, Sample]:
    """Each engine's first request (a miss), then (c)'s contexts into vLLM's own cache,
    then each engine's first hit, ``hit`` (a miss for (a)), by strategy name.

    A fresh engine's first hit runs code that no request ran before it, in vLLM and in a
    connector: it was 8-15 ms slower in (b) than in (c), where later queries differed by
    2 ms at the median (docs/benchmarks.md, 2026-11-29). An engine in service takes one
    such hit in its life; the measured queries come after it."""
    for name, engine in engines.items():
        time.sleep(IDLE_S)
        engine.ttft(workload.warmup, workload.max_tokens)
        if strategies[name].contexts_first:
            for context in workload.stored_contexts():
                engine.generate([context], 1)
    first_hits: dict[str, Sample] = {}
    for name, engine in engines.items():
        if hit is not None:
            time.sleep(IDLE_S)
            first_hits[name] = _sample(engine.ttft(hit, workload.max_tokens))
    return first_hits


def _sample(out: dict[str, Any]) -> Sample:
    marks = [(float(ms), str(name)) for ms, name in out.get("marks", [])]
    return Sample(out["ttft_s"], out["token_ids"], int(out["num_cached_tokens"]), marks)


def _progress(setup: Setup, results: dict[str, Results], cell: Cell, where: str) -> None:
    ttfts = "; ".join(
        f"{name} " + ", ".join(f"{s.ttft_s * 1e3:.0f}" for s in by_cell[cell])
        for name, by_cell in results.items()
    )
    setup.progress(f"  {where}, context {cell[0]}, query {cell[1]}: TTFT ms {ttfts}")


def write_contexts(setup: Setup, workload: Workload, name: str, config: dict[str, Any]) -> None:
    """A writer engine computes every context once and stores it through ``config``'s
    connector. (One writer per connector: vLLM 0.32's MultiConnector cannot merge the stats
    of connectors loaded from a module path, so it cannot combine the plugin with another.)"""
    writer = _start(setup, f"{name}-writer", kv_config=config)
    try:
        for context in workload.stored_contexts():
            # One at a time, so each context is prefilled in one step: the ExampleConnector
            # saves a request's blocks from its first step only, and under chunked prefill
            # would store a partial context under the whole context's name.
            writer.generate([context], 1)
    finally:
        writer.close()


def plugin_config(setup: Setup, chunk_size: int | None, **settings: Any) -> dict[str, Any]:
    """The plugin's config: ``chunk_size`` None leaves it unset (the plugin's default);
    ``settings``: other keys of its extra config."""
    if chunk_size is not None:
        settings = {**settings, "chunk_size": chunk_size}
    return kv_transfer_config(setup.server_socket, **settings)


def _start(setup: Setup, name: str, **kwargs: Any) -> EngineProc:
    setup.progress(f"starting engine {name}")
    trace = setup.log_dir / f"trace-{name}.txt"
    engine = start_engine(name, setup.model_dir, setup.log_dir, trace=trace, **kwargs)
    setup.progress(f"engine {name} ready in {engine.startup_s:.0f} s")
    return engine

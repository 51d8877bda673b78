"""The four ways of serving "context + query" that ``bench ttft`` compares, one engine each.

Every strategy gets the same prompts and returns one ``Sample`` per (cell, query). Engines
run one after another (never two computing at once), each with the same block size, batch
limit, KV space and core reservation (``vllm_common.start_engine``).

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

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcache_svc_bench.vllm.engines import EngineProc, example_connector_config, kv_transfer_config
from lmcache_svc_bench.vllm_common import BLOCK_SIZE, start_engine, wait_for_commits

Cell = tuple[int, int]  # (context tokens, query tokens)
# The plugin's default chunk for the benchmarks' block size: the smallest multiple of the
# block size of at least 128 tokens (``default_chunk_size`` in the plugin's config.py; a
# test in tests/vllm checks the two agree).
PLUGIN_DEFAULT_CHUNK = -(-128 // BLOCK_SIZE) * BLOCK_SIZE


@dataclass(frozen=True)
class Workload:
    contexts: dict[int, list[int]]  # context length -> tokens
    queries: dict[Cell, list[list[int]]]  # cell -> its queries
    warmup: list[int]  # an unrelated prompt as long as the longest one
    max_tokens: int

    def prompts(self, cell: Cell) -> list[list[int]]:
        return [self.contexts[cell[0]] + q for q in self.queries[cell]]


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


def measure(engine: EngineProc, workload: Workload, progress: Callable[[str], None]) -> Results:
    """Warm the engine up, then time every (cell, query) of the workload."""
    engine.ttft(workload.warmup, workload.max_tokens)
    return {cell: _measure_cell(engine, workload, cell, progress) for cell in workload.queries}


def _measure_cell(
    engine: EngineProc, workload: Workload, cell: Cell, progress: Callable[[str], None]
) -> list[Sample]:
    samples = []
    for prompt in workload.prompts(cell):
        out = engine.ttft(prompt, workload.max_tokens)
        marks = [(float(ms), str(name)) for ms, name in out.get("marks", [])]
        samples.append(
            Sample(out["ttft_s"], out["token_ids"], int(out["num_cached_tokens"]), marks)
        )
    ms = ", ".join(f"{s.ttft_s * 1e3:.0f}" for s in samples)
    progress(f"  {engine.name}: context {cell[0]}, query {cell[1]}: TTFT {ms} ms")
    return samples


def prompt_only(setup: Setup, workload: Workload) -> Results:
    engine = _start(setup, "a-prompt-only", prefix_caching=False)
    try:
        return measure(engine, workload, setup.progress)
    finally:
        engine.close()


def vllm_prefix_cache(setup: Setup, workload: Workload) -> Results:
    engine = _start(setup, "c-vllm-prefix")
    try:
        engine.ttft(workload.warmup, workload.max_tokens)
        results: Results = {}
        for length, context in workload.contexts.items():
            engine.generate([context], 1)  # the context, computed once
            for cell in workload.queries:
                if cell[0] == length:
                    results[cell] = _measure_cell(engine, workload, cell, setup.progress)
        return results
    finally:
        engine.close()


def write_contexts(setup: Setup, workload: Workload, name: str, config: dict[str, Any]) -> None:
    """A writer engine computes every context once and stores it through ``config``'s
    connector. (One writer per connector: vLLM 0.32's MultiConnector cannot merge the stats
    of connectors loaded from a module path, so it cannot combine the plugin with another.)"""
    writer = _start(setup, f"{name}-writer", kv_config=config)
    try:
        for context in workload.contexts.values():
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


def lmcache_svc(
    setup: Setup,
    workload: Workload,
    *,
    chunk_size: int | None,
    name: str,
    held_before: int = 0,
    **settings: Any,
) -> Results:
    """Measure (b); the contexts must have been written with ``plugin_config``, after the
    server held ``held_before`` chunks. ``settings``: other plugin settings of the engine."""
    chunk = PLUGIN_DEFAULT_CHUNK if chunk_size is None else chunk_size
    num_chunks = sum(len(c) // chunk for c in workload.contexts.values())
    held = wait_for_commits(setup.server_socket, held_before + num_chunks) - held_before
    setup.progress(f"  the server holds {held} chunks (the contexts alone: {num_chunks})")
    config = plugin_config(setup, chunk_size, **settings)
    engine = _start(setup, name, kv_config=config, prefix_caching=False)
    try:
        return measure(engine, workload, setup.progress)
    finally:
        engine.close()


def example_connector(setup: Setup, workload: Workload, storage_dir: Path) -> Results:
    """Measure (d); the contexts must have been written with ``example_connector_config``."""
    config = example_connector_config(storage_dir)
    engine = _start(setup, "d-example", kv_config=config, prefix_caching=False)
    try:
        return measure(engine, workload, setup.progress)
    finally:
        engine.close()


def _start(setup: Setup, name: str, **kwargs: Any) -> EngineProc:
    setup.progress(f"starting engine {name}")
    trace = setup.log_dir / f"trace-{name}.txt"
    engine = start_engine(name, setup.model_dir, setup.log_dir, trace=trace, **kwargs)
    setup.progress(f"engine {name} ready in {engine.startup_s:.0f} s")
    return engine

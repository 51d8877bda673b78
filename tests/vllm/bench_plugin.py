"""Measure the plugin against baselines taken in the same run (not a test).

    .venv/bin/python -m tests.vllm.bench_plugin [--shape tiny|medium] [--num-prompts N]
                                                [--prompt-len L] [--out results.json]

One server, three engine processes, the same prompts (``max_tokens=1``, so the time is a
prefill + one step: a TTFT proxy):
  ref   no plugin: each prompt cold, then again from vLLM's own prefix cache
  a     plugin, empty server: cold prompts (the zero-hit overhead: lookup + saves)
  b     plugin, fresh process: every prompt's prefix from the server (twice: the second
        pass loads into KV blocks vLLM has already touched)
  c     as b, with load_mode=async
Scheduler-side lookup latency comes from the plugin's own stats (nearest-rank p50/p99 of
every lookup, printed by vLLM as "KV Transfer metrics"); the baselines for it are a bare
gRPC lookup of the same hashes from this process and vLLM's step time.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from lmcache_svc.bench.procs import start_server
from lmcache_svc.bench.vllm.bench_model import MEDIUM, TINY, VOCAB_SIZE, Shape, make_tiny_model
from lmcache_svc.bench.vllm.engines import EngineProc, kv_transfer_config
from lmcache_svc.client import CacheClient
from lmcache_svc.keys import KVLayout, Namespace, chunk_hashes

_KV_LINE = re.compile(r"KV Transfer metrics: (.*)$")
_BENCH_ENV = {
    # Stats are logged only when asked (log_stats), so one line covers one whole pass.
    "VLLM_LOG_STATS_INTERVAL": "1000000",
    # vLLM's CPU backend reserves one more core when any KV connector is configured; on a
    # 2-core machine that leaves the plugin engines' workers both cores and the plain
    # engine's one. Reserve one core everywhere so all engines compute on the same core.
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
}


def main() -> None:
    args = _parse_args()
    shape = {"tiny": TINY, "medium": MEDIUM}[args.shape]
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model_dir = make_tiny_model(work / "model", shape)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, VOCAB_SIZE) for _ in range(args.prompt_len)]
        for _ in range(args.num_prompts)
    ]
    # A pre-faulted arena: a background prefault would compete with the ref engine for CPU.
    server = start_server(work, "--cpu-bytes", args.server_bytes, "--prefault", "sync")
    results: dict[str, Any] = {
        "shape": args.shape,
        "prompt_len": args.prompt_len,
        "num_prompts": len(prompts),
    }
    phases = set(args.phases.split(","))
    try:
        if "ref" in phases:
            results["ref"] = _run_ref(model_dir, work, prompts)
        config = kv_transfer_config(server.socket)
        results["a_cold_plugin"] = _run_plugin("a", model_dir, work, prompts, config)
        if "b" in phases:
            results["b_external_hit"] = _run_plugin(
                "b", model_dir, work, prompts, config, passes=args.passes
            )
        if "c" in phases:
            async_config = kv_transfer_config(server.socket, load_mode="async")
            results["c_external_hit_async"] = _run_plugin(
                "c", model_dir, work, prompts, async_config
            )
        results["grpc_lookup_baseline_ms"] = _bare_lookups(server.socket, model_dir, shape, prompts)
        results["copy_baseline_gbps"] = _copy_baseline(args.prompt_len * _kv_bytes_per_token(shape))
    finally:
        server.cleanup()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=["tiny", "medium"], default="tiny")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--prompt-len", type=int, default=4000)
    p.add_argument("--server-bytes", default="2GiB")
    p.add_argument("--out", default=None)
    p.add_argument("--keep", action="store_true", help="keep the work dir (engine logs)")
    p.add_argument("--phases", default="ref,b,c", help="of ref,b,c (a always runs)")
    p.add_argument("--passes", type=int, default=2, help="passes of engine b")
    return p.parse_args()


def _timed(engine: EngineProc, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    (out,) = engine.generate([prompt], 1)
    return time.perf_counter() - start, int(out["num_cached_tokens"])


def _run_ref(model_dir: Path, work: Path, prompts: list[list[int]]) -> dict[str, Any]:
    engine = EngineProc.start("ref", model_dir, work, env=_BENCH_ENV)
    try:
        _timed(engine, prompts[0])  # warm-up
        cold, local = [], []
        for prompt in prompts:
            engine.reset_prefix_cache()
            cold.append(_timed(engine, prompt)[0])
            local.append(_timed(engine, prompt)[0])
        return {
            "startup_s": engine.startup_s,
            "cold_s": _summary(cold),
            "local_hit_s": _summary(local),
        }
    finally:
        engine.close()


def _run_plugin(
    name: str,
    model_dir: Path,
    work: Path,
    prompts: list[list[int]],
    config: dict[str, Any],
    passes: int = 1,
) -> dict[str, Any]:
    """Each pass sends every prompt once; later passes start from an empty local prefix
    cache, so they hit the server again, into KV blocks vLLM has already touched."""
    engine = EngineProc.start(name, model_dir, work, kv_config=config, env=_BENCH_ENV)
    try:
        result: dict[str, Any] = {"startup_s": engine.startup_s}
        for i in range(passes):
            engine.reset_prefix_cache()
            result[f"pass{i + 1}"] = _one_pass(engine, prompts)
        return result
    finally:
        engine.close()


def _one_pass(engine: EngineProc, prompts: list[list[int]]) -> dict[str, Any]:
    engine.request(op="log_stats")  # start a fresh stats interval
    times, cached = [], []
    for prompt in prompts:
        seconds, num_cached = _timed(engine, prompt)
        times.append(seconds)
        cached.append(num_cached)
    time.sleep(0.5)
    engine.request(op="log_stats")
    return {
        "ttft_s": _summary(times),
        "num_cached_tokens": _summary([float(c) for c in cached]),
        "kv_transfer_metrics": _last_kv_line(engine),
    }


def _last_kv_line(engine: EngineProc) -> dict[str, float]:
    lines = [
        m.group(1) for m in map(_KV_LINE.search, engine.log_path.read_text().splitlines()) if m
    ]
    if not lines:
        return {}
    return {k: float(v) for k, v in (item.split("=") for item in lines[-1].split(", "))}


def _bare_lookups(
    socket: str, model_dir: Path, shape: Shape, prompts: list[list[int]]
) -> dict[str, float]:
    layout = KVLayout(
        "bfloat16", shape.num_layers, shape.num_kv_heads, shape.head_size, 128, "vllm-cpu/BHNC"
    )
    namespace = Namespace(model=str(model_dir), layout=layout, chunk_size=256)
    with CacheClient(socket) as client:
        ns_id = client.register_namespace(namespace)
        samples = []
        for _ in range(5):
            for prompt in prompts:
                hashes = chunk_hashes(namespace, prompt)
                start = time.perf_counter()
                client.lookup(ns_id, hashes)
                samples.append(time.perf_counter() - start)
    ms = sorted(s * 1e3 for s in samples)
    return {"p50": ms[len(ms) // 2], "p99": ms[int(len(ms) * 0.99)], "n": len(ms)}


def _kv_bytes_per_token(shape: Shape) -> int:
    return shape.num_layers * 2 * shape.num_kv_heads * shape.head_size * 2


def _copy_baseline(num_bytes: int) -> float:
    """numpy copy of one prompt's KV bytes between touched buffers (best of 5)."""
    src = np.ones(num_bytes, np.uint8)
    dst = np.zeros(num_bytes, np.uint8)
    best = min(_time_copy(dst, src) for _ in range(5))
    return num_bytes / best / 1e9


def _time_copy(dst: np.ndarray, src: np.ndarray) -> float:
    start = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - start


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "mean": statistics.fmean(ordered),
    }


if __name__ == "__main__":
    main()

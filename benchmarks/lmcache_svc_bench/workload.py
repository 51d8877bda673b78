"""``bench workload``: many users in multi-turn conversations against ``vllm serve``.

Simulated users hold conversations over a few long shared system prompts; every turn's
prompt is the whole history so far (``workload_trace``). The engine's own KV space
(``--num-gpu-blocks-override``) holds far fewer tokens than the conversations, and users
are interleaved turn by turn, so vLLM has evicted a user's history by the time the user's
next turn arrives and must recompute it, unless a KV connector brings it back.

The load comes from vLLM's own serving benchmark, ``vllm bench serve``, replaying the
conversations as a ``timed_trace`` dataset closed-loop (``--no-self-timed``, a fixed
``--max-concurrency``, requests in trace order), once per configuration against a fresh
``vllm serve``:

- ``plain``: vLLM with its prefix cache on, no connector;
- ``arena``: vLLM + the lmcache-svc plugin, the server with its shared-memory arena only;
- ``ssd``: the same with a smaller arena over an SSD tier, so most hits come from disk.

The report takes TTFT and throughput from the client's saved result, hit rates from vLLM's
``/metrics`` (its prefix cache, and the connector's external hits) and from the server's
``/metrics`` (chunk hits by tier, bytes read and written per tier).

``--set`` keys: ``model`` (tiny|medium), ``num_users``, ``num_turns``,
``num_system_prompts``, ``system_tokens``, ``turn_tokens``, ``output_tokens``,
``num_blocks`` (vLLM's KV blocks of 128 tokens), ``max_concurrency``, ``arena_mib`` (the
``arena`` configuration's, by default enough for every conversation), ``ssd_arena_mib``
and ``ssd_mib`` (the ``ssd`` configuration's arena, by default a fraction of the
conversations, and its SSD tier), ``configs`` (of plain,arena,ssd).
"""

from __future__ import annotations

import random
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmcache_svc.client.lookup_reports import DEFAULT_REPORT_INTERVAL_S
from lmcache_svc_bench.procs import ServerProc, start_server
from lmcache_svc_bench.report import Report
from lmcache_svc_bench.runner import BenchContext
from lmcache_svc_bench.vllm.engines import kv_transfer_config
from lmcache_svc_bench.vllm_common import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    kv_bytes_per_token,
    make_model,
    random_tokens,
    require_vllm,
    shape_named,
)
from lmcache_svc_bench.workload_report import ConfigResult, write_report
from lmcache_svc_bench.workload_serve import (
    SERVED_NAME,
    Metrics,
    VllmServer,
    run_client,
    scrape,
)
from lmcache_svc_bench.workload_trace import Conversations, write_tokenizer, write_trace

CONFIGS = ("plain", "arena", "ssd")
CLIENT_TIMEOUT_S = 420.0


@dataclass(frozen=True)
class Params:
    model: str
    conversations: Conversations
    num_blocks: int
    max_concurrency: int
    arena_mib: int
    ssd_arena_mib: int
    ssd_mib: int
    configs: tuple[str, ...]

    def check(self) -> None:
        shape_named(self.model)
        self.conversations.check(MAX_MODEL_LEN)
        unknown = set(self.configs) - set(CONFIGS)
        if unknown or not self.configs:
            raise ValueError(
                f"configs must be of {','.join(CONFIGS)}, got {','.join(self.configs)}"
            )
        longest = self.conversations.prompt_tokens(self.conversations.num_turns)
        need = self.max_concurrency * -(-(longest + self.conversations.output_tokens) // BLOCK_SIZE)
        if self.num_blocks < need:
            raise ValueError(
                f"num_blocks {self.num_blocks} < {need}: the engine could not hold "
                f"{self.max_concurrency} of the longest requests at once"
            )
        if self.num_blocks * BLOCK_SIZE >= self.conversations.distinct_tokens():
            raise ValueError(
                f"num_blocks {self.num_blocks} holds every conversation "
                f"({self.conversations.distinct_tokens()} tokens): vLLM would never evict"
            )
        for name in ("max_concurrency", "arena_mib", "ssd_arena_mib", "ssd_mib"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def params(ctx: BenchContext) -> Params:
    quick = ctx.quick
    conversations = Conversations(
        num_users=ctx.option("num_users", 8 if quick else 16),
        num_turns=ctx.option("num_turns", 4 if quick else 6),
        num_system_prompts=ctx.option("num_system_prompts", 2),
        system_tokens=ctx.option("system_tokens", 1024 if quick else 2048),
        turn_tokens=ctx.option("turn_tokens", 256),
        output_tokens=ctx.option("output_tokens", 16),
        block_tokens=BLOCK_SIZE,
    )
    p = Params(
        model=ctx.option("model", "tiny"),
        conversations=conversations,
        num_blocks=ctx.option("num_blocks", 40 if quick else 72),
        max_concurrency=ctx.option("max_concurrency", 2),
        arena_mib=ctx.option("arena_mib", 64 if quick else 128),
        ssd_arena_mib=ctx.option("ssd_arena_mib", 8 if quick else 16),
        ssd_mib=ctx.option("ssd_mib", 1024),
        configs=tuple(ctx.option("configs", ",".join(CONFIGS)).split(",")),
    )
    p.check()
    return p


def max_model_len(p: Params) -> int:
    """The longest request, in whole blocks: vLLM refuses a max_model_len its KV space
    could not hold."""
    c = p.conversations
    return -(-(c.prompt_tokens(c.num_turns) + c.output_tokens) // BLOCK_SIZE) * BLOCK_SIZE


def serve_args(p: Params) -> list[str]:
    return [
        "--max-model-len", str(max_model_len(p)),
        "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
        "--block-size", str(BLOCK_SIZE),
        "--num-gpu-blocks-override", str(p.num_blocks),
        "--enable-prefix-caching",
        "--enforce-eager",
    ]  # fmt: skip


def client_args(p: Params, url: str, model_dir: Path, trace: Path, result: Path) -> list[str]:
    return [
        "--backend", "openai",
        "--base-url", url,
        "--endpoint", "/v1/completions",
        "--model", str(model_dir),
        "--served-model-name", SERVED_NAME,
        "--dataset-name", "timed_trace",
        "--dataset-path", str(trace),
        "--timed-trace-chunk-hash-size", str(BLOCK_SIZE),
        "--no-self-timed",
        "--num-prompts", str(p.conversations.num_requests),
        "--request-rate", "inf",
        "--max-concurrency", str(p.max_concurrency),
        "--temperature", "0",
        "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,e2el",
        "--metric-percentiles", "50,99",
        "--save-result",
        "--save-detailed",
        "--result-dir", str(result.parent),
        "--result-filename", result.name,
        "--disable-tqdm",
    ]  # fmt: skip


def run(ctx: BenchContext) -> Report:
    require_vllm()
    p = params(ctx)
    c = p.conversations
    shape = shape_named(p.model)
    model_dir = make_model(ctx.work_dir, p.model)
    write_tokenizer(model_dir)
    trace = write_trace(ctx.work_dir / "conversations.jsonl", c)
    ctx.progress(
        f"{c.num_users} users x {c.num_turns} turns = {c.num_requests} requests; "
        f"{c.distinct_tokens()} distinct tokens "
        f"({c.distinct_tokens() * kv_bytes_per_token(shape) / 2**20:.0f} MiB of KV) vs "
        f"vLLM's {p.num_blocks * BLOCK_SIZE} tokens of KV space"
    )
    results: list[ConfigResult] = []
    for name in p.configs:
        results.append(run_config(ctx, p, name, model_dir, trace))
    report = ctx.report()
    write_report(report, p, results, ctx.out_dir, bytes_per_token=kv_bytes_per_token(shape))
    report.data["params"] = asdict(p)
    return report


def run_config(
    ctx: BenchContext, p: Params, name: str, model_dir: Path, trace: Path
) -> ConfigResult:
    server: ServerProc | None = None
    vllm: VllmServer | None = None
    args = serve_args(p)
    try:
        if name != "plain":
            server = _start_sidecar(ctx, p, name)
            kv_config = kv_transfer_config(server.socket)
            args += ["--kv-transfer-config", _json(kv_config)]
        ctx.progress(f"{name}: starting vllm serve")
        vllm = VllmServer.start(model_dir, ctx.work_dir / f"vllm-{name}.log", args)
        ctx.progress(f"{name}: vllm serve ready in {vllm.startup_s:.0f} s; warm-up")
        vllm.complete(random_tokens(random.Random(name), 512), 2)  # first touch, connections
        before, side_before = vllm.metrics(), _sidecar_metrics(server)
        result_path = ctx.out_dir / f"workload-client-{name}.json"
        ctx.out_dir.mkdir(parents=True, exist_ok=True)
        cargs = client_args(p, vllm.url, model_dir, trace, result_path)
        wall_s = run_client(cargs, ctx.work_dir / f"client-{name}.log", CLIENT_TIMEOUT_S)
        # The last steps' stats and the last stores' commits; with a sidecar, also the
        # plugin's last report of the lookups it answered from the lookup index.
        time.sleep(1.0 if server is None else DEFAULT_REPORT_INTERVAL_S + 1.0)
        after, side_after = vllm.metrics(), _sidecar_metrics(server)
        ctx.progress(f"{name}: client done in {wall_s:.0f} s")
        return ConfigResult.collect(
            name, result_path, before, after, side_before, side_after, _command(cargs)
        )
    finally:
        if vllm is not None:
            vllm.stop()
        if server is not None:
            server.cleanup()


def _start_sidecar(ctx: BenchContext, p: Params, name: str) -> ServerProc:
    arena_mib = p.ssd_arena_mib if name == "ssd" else p.arena_mib
    args = ["--cpu-bytes", f"{arena_mib}MiB", "--prefault", "sync"]
    if name == "ssd":
        ssd_dir = ctx.work_dir / "ssd"
        ssd_dir.mkdir(exist_ok=True)
        args += ["--ssd-path", str(ssd_dir), "--ssd-bytes", f"{p.ssd_mib}MiB"]
    return start_server(ctx.work_dir, *args)


def _sidecar_metrics(server: ServerProc | None) -> Metrics | None:
    return None if server is None else scrape(server.http_url.rstrip("/") + "/metrics")


def _json(value: Any) -> str:
    import json

    return json.dumps(value, separators=(",", ":"))


def _command(args: list[str]) -> str:
    return "PYTHONHASHSEED=0 vllm bench serve " + shlex.join(args)

"""``bench routing``: two engines, each with its own sidecar (two nodes), optionally one
Redis Cluster behind both sidecars; the multi-user workload of ``bench workload`` driven by
vLLM's own serving client through a router that sends each request (a) round robin or
(b) to the engine the KV events say holds most of its prefix (NVIDIA Dynamo's standalone
indexer reading both engines' event streams, in which the plugin announces what each
sidecar holds). Side by side in one run: TTFT mean/p99, hit rates by tier, throughput;
and the events' cost on the store path (``routing_cost.py``), on vs off.

The engines start once; before each configuration the sidecars (and the Redis Cluster)
start afresh and vLLM's own prefix cache is reset, so every configuration starts cold.

``--set`` keys: those of ``bench workload`` (``num_users``, ``num_turns``, ...) plus
``configs`` (of rr,events,rr-redis,events-redis; quick: rr,events) and ``cost_rounds``.
Targets: events' TTFT p99 at least 2x better than round robin's without Redis, better with
Redis; the store path with events under 2% slower.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lmcache_svc_bench.procs import ServerProc, start_server
from lmcache_svc_bench.redis_procs import RedisClusterProcs, start_redis_cluster
from lmcache_svc_bench.report import Report
from lmcache_svc_bench.routing_cost import EVENTS_ENV, StoreCost, measure
from lmcache_svc_bench.routing_proxy import Router, by_index, load_vocab, round_robin
from lmcache_svc_bench.runner import BenchContext
from lmcache_svc_bench.vllm.engines import kv_transfer_config
from lmcache_svc_bench.vllm_common import make_model, random_tokens, require_vllm
from lmcache_svc_bench.workload import (
    CLIENT_TIMEOUT_S,
    Params,
    client_args,
    params,
    serve_args,
)
from lmcache_svc_bench.workload_serve import Metrics, VllmServer, run_client, scrape
from lmcache_svc_bench.workload_trace import write_tokenizer, write_trace

CONFIGS = ("rr", "events", "rr-redis", "events-redis")
NUM_ENGINES = 2
DYNAMO_PYTHON = Path(__file__).resolve().parents[2] / ".venv-dynamo" / "bin" / "python"


@dataclass
class Outcome:
    name: str
    client: dict[str, Any]
    routed: list[int]
    hit_tokens_by_tier: dict[str, float]
    prompt_tokens: float
    external_hit_tokens: float


def run(ctx: BenchContext) -> Report:
    require_vllm()
    if not DYNAMO_PYTHON.exists():
        raise RuntimeError(f"{DYNAMO_PYTHON} is missing: run scripts/setup_dynamo.sh")
    # the workload's parameters, checked as bench workload checks them (its own configs)
    p = params(replace(ctx, options={k: v for k, v in ctx.options.items() if k != "configs"}))
    default = "rr,events" if ctx.quick else ",".join(CONFIGS)
    configs = tuple(str(ctx.option("configs", default)).split(","))
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        raise ValueError(f"configs must be of {','.join(CONFIGS)}, got {sorted(unknown)}")
    model_dir = make_model(ctx.work_dir, p.model)
    write_tokenizer(model_dir)
    trace = write_trace(ctx.work_dir / "conversations.jsonl", p.conversations)
    outcomes = run_configs(ctx, p, configs, model_dir, trace)
    ctx.progress("store path: events on vs off")
    cost = measure(ctx.work_dir, rounds=ctx.option("cost_rounds", 40 if ctx.quick else 200))
    report = ctx.report()
    write_report(report, outcomes, cost)
    return report


def run_configs(
    ctx: BenchContext, p: Params, configs: tuple[str, ...], model_dir: Path, trace: Path
) -> list[Outcome]:
    sockets = [str(ctx.work_dir / f"sidecar-{i}" / "grpc.sock") for i in range(NUM_ENGINES)]
    for s in sockets:
        Path(s).parent.mkdir(parents=True, exist_ok=True)
    engines: list[VllmServer] = []
    outcomes: list[Outcome] = []
    try:
        for i, socket in enumerate(sockets):
            args = serve_args(p) + [
                "--kv-transfer-config", _json(kv_transfer_config(socket, retry_interval_s=0.2)),
                "--kv-events-config", _json({
                    "enable_kv_cache_events": True, "publisher": "zmq",
                    "endpoint": f"ipc://{ctx.work_dir}/engine-{i}.events",
                }),
            ]  # fmt: skip
            ctx.progress(f"starting engine {i}")
            engines.append(
                VllmServer.start(
                    model_dir, ctx.work_dir / f"vllm-{i}.log", args,
                    env={"VLLM_SERVER_DEV_MODE": "1"},
                )
            )  # fmt: skip
        for name in configs:
            outcomes.append(run_config(ctx, p, name, engines, sockets, model_dir, trace))
    finally:
        for engine in engines:
            engine.stop()
    return outcomes


def run_config(
    ctx: BenchContext,
    p: Params,
    name: str,
    engines: list[VllmServer],
    sockets: list[str],
    model_dir: Path,
    trace: Path,
) -> Outcome:
    cluster: RedisClusterProcs | None = None
    sidecars: list[ServerProc] = []
    router: Router | None = None
    indexer: Any = None
    try:
        extra: list[str] = []
        if name.endswith("-redis"):
            cluster = start_redis_cluster(ctx.work_dir / f"redis-{name}")
            extra = ["--redis-url", cluster.url, "--redis-cluster"]
        for socket in sockets:
            sidecars.append(
                start_server(
                    ctx.work_dir, "--cpu-bytes", f"{p.arena_mib}MiB", "--prefault", "sync",
                    *extra, env=EVENTS_ENV, socket_path=socket,
                )
            )  # fmt: skip
        for engine in engines:
            _post(engine.url + "/reset_prefix_cache")
            engine.complete(random_tokens(random.Random(name), 256), 1)  # reconnect, warm
        policy = round_robin()
        if name.startswith("events"):
            indexer = _start_indexer(ctx, [f"ipc://{ctx.work_dir}/engine-{i}.events"
                                           for i in range(len(engines))])  # fmt: skip
            policy = by_index(indexer[1])
        vocab = load_vocab(model_dir)
        backends = [_host_port(e.url) for e in engines]
        router = Router(backends, policy, vocab).start()
        before = [e.metrics() for e in engines]
        side_before = [_side(s) for s in sidecars]
        result = ctx.out_dir / f"routing-client-{name}.json"
        ctx.out_dir.mkdir(parents=True, exist_ok=True)
        ctx.progress(f"{name}: client running")
        run_client(
            client_args(p, router.url, model_dir, trace, result),
            ctx.work_dir / f"client-{name}.log",
            CLIENT_TIMEOUT_S,
        )
        time.sleep(2.0)
        after = [e.metrics() for e in engines]
        side_after = [_side(s) for s in sidecars]
        return _outcome(name, result, router.routed, before, after, side_before, side_after)
    finally:
        if router is not None:
            router.stop()
        if indexer is not None:
            indexer[0].terminate()
            indexer[0].wait(10)
        for sidecar in sidecars:
            sidecar.cleanup()
        if cluster is not None:
            cluster.stop()


def _outcome(
    name: str,
    result: Path,
    routed: list[int],
    before: list[Metrics],
    after: list[Metrics],
    side_before: list[Metrics],
    side_after: list[Metrics],
) -> Outcome:
    def delta(pairs: list[tuple[Metrics, Metrics]], metric: str, **labels: str) -> float:
        return sum(a.sum(metric, **labels) - b.sum(metric, **labels) for b, a in pairs)

    engines = list(zip(before, after))
    sides = list(zip(side_before, side_after))
    by_tier: dict[str, float] = {}
    for _, a in sides:
        for tier in a.label_values("lmcache_svc_chunk_hits_total", "tier"):
            by_tier[tier] = delta(sides, "lmcache_svc_chunk_hits_total", tier=tier)
    return Outcome(
        name,
        json.loads(result.read_text()),
        list(routed),
        by_tier,
        delta(engines, "vllm:prompt_tokens_total"),
        delta(engines, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
    )


def write_report(report: Report, outcomes: list[Outcome], cost: StoreCost) -> None:
    table = report.table(
        "Routing: round robin vs the KV events (Dynamo's indexer), same engines, same run",
        ["config", "TTFT mean ms", "TTFT p99 ms", "req/s", "output tok/s",
         "prompt tokens loaded from sidecars", "sidecar chunk hits by tier",
         "requests per engine", "completed"],
    )  # fmt: skip
    for o in outcomes:
        c = o.client
        table.add(
            o.name, round(c.get("mean_ttft_ms", 0.0)), round(c.get("p99_ttft_ms", 0.0)),
            round(c.get("request_throughput", 0.0), 2), round(c.get("output_throughput", 0.0), 1),
            f"{o.external_hit_tokens / o.prompt_tokens:.0%}" if o.prompt_tokens else "-",
            ", ".join(f"{t} {n:.0f}" for t, n in sorted(o.hit_tokens_by_tier.items())) or "-",
            "/".join(str(n) for n in o.routed), c.get("completed"),
        )  # fmt: skip
    by_name = {o.name: o for o in outcomes}
    for base, with_events, goal in (("rr", "events", 2.0), ("rr-redis", "events-redis", 1.0)):
        if base in by_name and with_events in by_name:
            b = float(by_name[base].client.get("p99_ttft_ms", 0.0))
            e = float(by_name[with_events].client.get("p99_ttft_ms", 0.0))
            report.target(
                f"TTFT p99, {base} / {with_events} ({b:.0f} ms / {e:.0f} ms, same run)",
                round(b / e, 2) if e else 0.0,
                goal if goal > 1 else 1.01,
                "x",
            )
    cost_table = report.table(
        "The events' cost on the store path (same-host client: prepare, copy, commit)",
        ["events", "us per chunk (median)", "chunk bytes", "chunks per store", "rounds"],
    )
    cost_table.add("off", round(cost.off_us_per_chunk), cost.chunk_bytes,
                   cost.chunks_per_store, cost.rounds)  # fmt: skip
    cost_table.add("on", round(cost.on_us_per_chunk), cost.chunk_bytes,
                   cost.chunks_per_store, cost.rounds)  # fmt: skip
    report.target(
        "store path with events vs without (same run)",
        round(100 * cost.overhead, 1), 2.0, "%", lower_is_better=True,
    )  # fmt: skip
    report.data["routing"] = [o.__dict__ for o in outcomes]
    report.data["store_cost"] = cost.__dict__


def _start_indexer(ctx: BenchContext, endpoints: list[str]) -> tuple[Any, str]:
    import subprocess

    from lmcache_svc_bench.held_signals import start_process
    from lmcache_svc_bench.procs import free_port

    port = free_port()
    workers = ",".join(f"{i + 1}={e}" for i, e in enumerate(endpoints))
    log = open(ctx.work_dir / f"dynamo-{port}.log", "wb")  # noqa: SIM115 - the child owns it
    proc = start_process(
        [str(DYNAMO_PYTHON), "-m", "dynamo.indexer", "--block-size", "128",
         "--port", str(port), "--threads", "1", "--workers", workers],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    try:  # Ctrl-C while it starts must not leave it running
        while time.monotonic() < deadline:
            try:
                _post(url + "/query", {"token_ids": [1], "model_name": "default"})
                return proc, url
            except OSError:
                time.sleep(0.2)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    proc.terminate()
    raise RuntimeError("dynamo.indexer did not start")


def _post(url: str, body: dict[str, Any] | None = None) -> None:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        answer.read()


def _side(server: ServerProc) -> Metrics:
    return scrape(server.http_url.rstrip("/") + "/metrics")


def _host_port(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").rpartition(":")
    return host, int(port)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))

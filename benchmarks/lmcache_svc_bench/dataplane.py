"""``lmcache-svc bench dataplane``: bytes through the server next to a plain copy, and next
to LMCache 0.5.6 on the same KV shape.

1. Chunk-size sweep (2, 8, 32 MiB): the plugin's shared-memory store and load (one
   prepare/commit per request of ``request_mib``, torch copies into/out of the slots, every
   round trip timed), inline gRPC put/get and REST octet-stream PUT/GET, each next to a
   torch copy of the same bytes, timed just before it in the same process, between the same
   kinds of pre-touched memory (engine tensor to /dev/shm pages and back).
2. Side by side: LMCache's own client (``lmcache bench server``, engine-driven) against its
   server, and ours doing the same calls (one store and one retrieve of a request's full
   256-token chunks, 8 MiB each, a lookup before each) on the same total bytes, both pools
   pre-faulted. Throughput is ``call bytes / p50 call latency`` for both.

Options (``--set key=value``): ``total_mib`` (bytes per chunk size per path per round),
``rounds``, ``request_mib`` (bytes per prepare/commit in the sweep), ``lmcache``
(false: skip the peer), ``lmcache_tokens`` (tokens per LMCache request), ``lmcache_calls``
(requests per round), ``lmcache_venv`` (an existing venv), ``torch_threads`` (torch
intra-op threads for every copy, ours and LMCache's processes alike; default 1: on this
2-vCPU VM a 2-thread torch copy ran at ~1 GB/s whenever the other vCPU was busy, against
~15 GB/s on one thread).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import torch

from lmcache_svc.client import CacheClient
from lmcache_svc_bench import lmcache_peer as peer
from lmcache_svc_bench import plots
from lmcache_svc_bench.dataplane_paths import (
    Buffers,
    Workload,
    namespace_for,
    time_copy,
    time_grpc_get,
    time_grpc_put,
    time_rest_get,
    time_rest_put,
    time_shm_load,
    time_shm_store,
    time_shm_store_pooled,
)
from lmcache_svc_bench.dataplane_side import OursRun, run_ours_like_peer
from lmcache_svc_bench.procs import start_server
from lmcache_svc_bench.report import Report
from lmcache_svc_bench.runner import BenchContext
from lmcache_svc_bench.stats import gbps, median

MiB = 1 << 20
SIZES_MIB = (2, 8, 32)
COPY = "torch copy (baseline)"
Mover = Callable[[bytes, list[list[bytes]], Buffers], float]
PATHS = (
    "shm store",
    "shm store (prepare per request)",
    "shm load",
    "gRPC put",
    "gRPC get",
    "REST PUT",
    "REST GET",
)


@dataclass(slots=True)
class Sweep:
    """GB/s per path and chunk size, each with the copy timed right before it (``ratio``)."""

    gbps: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    ratio: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)

    def add(self, name: str, size: int, value: float, copy: float) -> None:
        for key, figure in ((name, value), (COPY, copy)):
            self.gbps.setdefault(key, {}).setdefault(size, []).append(figure)
        self.ratio.setdefault(name, {}).setdefault(size, []).append(value / copy)

    def check(self, what: str, ok: bool) -> None:
        self.checks[what] = self.checks.get(what, True) and ok

    def median(self, name: str, size: int) -> float:
        return median(self.gbps[name][size])

    def median_ratio(self, name: str, size: int) -> float:
        return median(self.ratio[name][size])


@dataclass(frozen=True, slots=True)
class Params:
    total_mib: int
    rounds: int
    request_mib: int
    lmcache: bool
    lmcache_tokens: int
    lmcache_calls: int
    lmcache_venv: str
    torch_threads: int

    @classmethod
    def from_ctx(cls, ctx: BenchContext) -> Params:
        p = cls(
            total_mib=ctx.option("total_mib", 256 if ctx.quick else 1024),
            rounds=ctx.option("rounds", 1 if ctx.quick else 3),
            request_mib=ctx.option("request_mib", 128),
            lmcache=ctx.option("lmcache", True),
            lmcache_tokens=ctx.option("lmcache_tokens", 4095),
            lmcache_calls=ctx.option("lmcache_calls", 2 if ctx.quick else 8),
            lmcache_venv=ctx.option("lmcache_venv", ""),
            torch_threads=ctx.option("torch_threads", 1),
        )
        for name in ("total_mib", "rounds", "request_mib", "lmcache_calls", "torch_threads"):
            if getattr(p, name) < 1:
                raise ValueError(f"--set {name} must be at least 1, got {getattr(p, name)}")
        if peer.call_bytes(p.lmcache_tokens) == 0:
            raise ValueError(f"--set lmcache_tokens must be >= {peer.CHUNK_TOKENS}")
        return p

    @property
    def side_bytes(self) -> int:
        return self.lmcache_calls * peer.call_bytes(self.lmcache_tokens)


def run(ctx: BenchContext) -> Report:
    p = Params.from_ctx(ctx)
    threads = torch.get_num_threads()
    torch.set_num_threads(p.torch_threads)
    try:
        return _run(ctx, p)
    finally:
        torch.set_num_threads(threads)


def _run(ctx: BenchContext, p: Params) -> Report:
    report = ctx.report()
    # room for the bytes stored, plus reservations (a store pool of two requests, or two
    # requests prepared at once) well under max_reserved_fraction (half the arena)
    stored_mib = math.ceil(max(p.total_mib * MiB, p.side_bytes) * 1.25 / MiB / 64) * 64
    arena_mib = stored_mib + 4 * p.request_mib + 128
    sweep = Sweep()
    ours: list[OursRun] = []
    theirs: list[peer.PeerRun] = []
    unavailable = "" if p.lmcache else "skipped (--set lmcache=false)"
    lmc: peer.LMCacheServer | None = None
    ctx.progress(f"our server: {arena_mib} MiB arena, --prefault sync")
    server = start_server(
        ctx.work_dir, "--cpu-bytes", f"{arena_mib}MiB", "--prefault", "sync", timeout_s=120
    )
    try:
        if p.lmcache:
            lmc, unavailable = _start_peer(ctx, p)  # its processes get OMP_NUM_THREADS too
        with (
            CacheClient(server.socket, timeout_s=120) as client,
            CacheClient(server.socket, timeout_s=120, local_lookup=True) as index_client,
            httpx.Client(base_url=server.http_url, timeout=300) as http,
        ):
            if not client.wait_shm_ready() or not index_client.shm_available:
                raise RuntimeError("the server's shared segment could not be mapped here")
            for r in range(p.rounds):
                ctx.progress(f"round {r + 1}/{p.rounds}: chunk sizes {SIZES_MIB} MiB")
                _sweep_round(p, client, http, sweep, server.wait_idle)
                ctx.progress(f"round {r + 1}/{p.rounds}: ours on LMCache's shape")
                ours.append(
                    run_ours_like_peer(client, p.lmcache_tokens, p.lmcache_calls, index_client)
                )
                if lmc is not None and not unavailable:
                    ctx.progress(f"round {r + 1}/{p.rounds}: LMCache's client")
                    unavailable = _peer_round(ctx, p, lmc, r, theirs)
    finally:
        server.cleanup()
        if lmc is not None:
            lmc.stop()
    _sweep_table(report, p, sweep)
    _side_table(report, p, ours, theirs, unavailable)
    _targets(report, p, sweep, ours, theirs)
    _plot(ctx, report, sweep)
    report.data.update(
        params=vars_of(p), sweep_gbps=sweep.gbps, sweep_vs_copy=sweep.ratio,
        checks=sweep.checks,
        ours=[o.to_dict() for o in ours], lmcache=[t.raw for t in theirs],
        lmcache_unavailable=unavailable,
    )  # fmt: skip
    return report


def vars_of(p: Params) -> dict[str, Any]:
    return {k: getattr(p, k) for k in p.__slots__}


# -- the chunk-size sweep ------------------------------------------------------------------


def _sweep_round(
    p: Params, client: CacheClient, http: httpx.Client, sweep: Sweep, settle: Callable[[], bool]
) -> None:
    """Each copy and path starts with the server idle (``settle``): the background work
    after the previous path (its checksums) runs before the next pair is timed, not in it."""
    for size in SIZES_MIB:
        w = Workload(size * MiB, p.total_mib * MiB, p.request_mib * MiB)
        bufs = Buffers(w)
        time_copy(w, bufs, "store")  # warm-up
        ns_id = client.register_namespace(namespace_for(w.chunk_bytes))
        movers: list[tuple[str, Mover, Mover]] = [
            ("shm", partial(time_shm_store_pooled, client), partial(time_shm_load, client)),
            ("gRPC", partial(time_grpc_put, client), partial(time_grpc_get, client)),
            ("REST", partial(time_rest_put, http), partial(time_rest_get, http)),
        ]
        for label, put, get in movers:
            store_name, load_name = f"{label} {_STORE[label]}", f"{label} {_LOAD[label]}"
            if label == "shm":  # the store before the pool, for comparison (bytes dropped)
                _time_store(w, bufs, sweep, size, "shm store (prepare per request)",
                            partial(time_shm_store, client), ns_id, client, settle)  # fmt: skip
            requests = w.request_hashes()
            settle()
            copy = gbps(w.moved_bytes, time_copy(w, bufs, "store"))
            sweep.add(store_name, size, gbps(w.moved_bytes, put(ns_id, requests, bufs)), copy)
            settle()
            copy = gbps(w.moved_bytes, time_copy(w, bufs, "load"))
            bufs.clear_dst()
            sweep.add(load_name, size, gbps(w.moved_bytes, get(ns_id, requests, bufs)), copy)
            sweep.check(f"{label} {size} MiB", bufs.verified())
            client.delete(ns_id, [h for hashes in requests for h in hashes])
        del bufs


_STORE = {"shm": "store", "gRPC": "put", "REST": "PUT"}
_LOAD = {"shm": "load", "gRPC": "get", "REST": "GET"}


def _time_store(
    w: Workload, bufs: Buffers, sweep: Sweep, size: int, name: str, put: Mover,
    ns_id: bytes, client: CacheClient, settle: Callable[[], bool],
) -> None:  # fmt: skip
    requests = w.request_hashes()
    settle()
    copy = gbps(w.moved_bytes, time_copy(w, bufs, "store"))
    sweep.add(name, size, gbps(w.moved_bytes, put(ns_id, requests, bufs)), copy)
    client.delete(ns_id, [h for hashes in requests for h in hashes])


def _sweep_table(report: Report, p: Params, sweep: Sweep) -> None:
    cols = [f"{s} MiB" for s in SIZES_MIB]
    table = report.table(
        f"Throughput by chunk size, GB/s (median of {p.rounds} round(s), "
        f"{p.total_mib} MiB per size per path)",
        ["path", *cols, "vs copy at 8 MiB"],
    )
    table.add(COPY, *(sweep.median(COPY, s) for s in SIZES_MIB), "100%")
    for name in PATHS:
        values = [sweep.median(name, s) for s in SIZES_MIB]
        table.add(name, *values, f"{sweep.median_ratio(name, 8):.0%}")
    table.notes.append(
        f"shm store: per {p.request_mib} MiB request, slots taken from the worker's store "
        "pool (reserved ahead, refilled in the background; filled once before the clock "
        "starts), torch copies into them, one bind (CommitStore with reserved_as) on an I/O "
        "thread, as the vLLM plugin's worker does with tuning.store_pool_chunks > 0 (off by "
        "default); timed until the last bind returned. shm store (prepare per request): the "
        "plugin's default path, one prepare_store per request paid before its copies, one "
        "commit_store on the I/O thread. shm load: one "
        "prepare_load per request, copies out of each slot, release_load on the I/O thread. "
        "In the side-by-side below every call is serial. gRPC: CacheClient.put/get, one stream "
        "per request. REST: one PUT/GET per chunk (httpx, keep-alive), bytes copied into the "
        "destination tensor."
    )
    table.notes.append(
        f"All copies (baseline, ours, LMCache's client) on {p.torch_threads} torch thread(s) "
        "(--set torch_threads). "
        "Baseline: torch copies of the same bytes in this process, from the source tensor into "
        "pre-faulted /dev/shm pages (before each store) and back into the destination tensor "
        "(before each load). "
        "Same memory state everywhere: source and destination tensors touched before timing, "
        "server arena pre-faulted (--prefault sync), client mapping pre-faulted "
        "(CacheClient.wait_shm_ready). Every copy starts with the server idle (its threads "
        "under 5 ms of CPU in 100 ms): the previous path's background work (its checksums) "
        "is in neither the copy nor the path after it. 'vs copy': each path's GB/s over "
        "the copy timed just before it, median of those ratios. Bytes read back equal the "
        "bytes written: "
        + ("yes for every path and size" if all(sweep.checks.values()) else f"NO: {sweep.checks}")
    )


# -- side by side with LMCache -------------------------------------------------------------


def _start_peer(ctx: BenchContext, p: Params) -> tuple[peer.LMCacheServer | None, str]:
    try:
        venv = peer.ensure_venv(ctx.progress, Path(p.lmcache_venv) if p.lmcache_venv else None)
        l1_gb = peer.pool_gb(p.side_bytes * p.rounds)
        ctx.progress(f"starting lmcache server (L1 pool {l1_gb:g} GiB)")
        server = peer.LMCacheServer(venv, ctx.work_dir, l1_gb, threads=p.torch_threads)
    except (peer.PeerUnavailable, OSError) as e:
        ctx.progress(f"LMCache unavailable: {e}")
        return None, str(e)
    try:
        server.wait_ready()
        ctx.progress(f"LMCache pool pre-faulted in {server.prefault_pool():.1f} s")
    except (peer.PeerUnavailable, OSError) as e:
        server.stop()
        ctx.progress(f"LMCache unavailable: {e}")
        return None, str(e)
    return server, ""


def _peer_round(
    ctx: BenchContext, p: Params, lmc: peer.LMCacheServer, r: int, theirs: list[peer.PeerRun]
) -> str:
    try:
        theirs.append(
            peer.run_client(
                lmc, ctx.work_dir, num_tokens=p.lmcache_tokens,
                first_seq=r * 10_000, num_calls=p.lmcache_calls,
            )
        )  # fmt: skip
    except (peer.PeerUnavailable, OSError) as e:
        ctx.progress(f"LMCache run failed: {e}")
        return str(e)
    return ""


def _side_table(
    report: Report,
    p: Params,
    ours: list[OursRun],
    theirs: list[peer.PeerRun],
    unavailable: str,
) -> None:
    call = peer.call_bytes(p.lmcache_tokens)
    table = report.table(
        f"Side by side with LMCache {peer.LMCACHE_VERSION} (8 MiB chunks, "
        f"{call // MiB} MiB per store/retrieve call, {p.lmcache_calls} calls per round, "
        f"median of {p.rounds} round(s))",
        ["server", "store GB/s", "retrieve GB/s", "lookup p50 ms", "store ms/call",
         "retrieve ms/call", "data checked"],
    )  # fmt: skip
    o = _ours_medians(ours)
    verified = all(x.verified for x in ours)
    table.add("lmcache-svc (lookup: gRPC round trip)", gbps(call, o["store_s"]),
              gbps(call, o["load_s"]), o["grpc_lookup_ms"], o["store_s"] * 1e3,
              o["load_s"] * 1e3, verified)  # fmt: skip
    if o["index_lookup_ms"] is not None:
        table.add("lmcache-svc lookup from the shm index (the plugin's path)", "", "",
                  o["index_lookup_ms"], "", "", "")  # fmt: skip
    if theirs:
        t = _peer_medians(theirs)
        table.add(f"LMCache {peer.LMCACHE_VERSION} (its own client)", gbps(call, t["store_s"]),
                  gbps(call, t["load_s"]), t["lookup_ms"], t["store_s"] * 1e3,
                  t["load_s"] * 1e3, all(x.checksum_ok == x.num_calls for x in theirs))  # fmt: skip
        table.add("ratio (ours / LMCache; lookup: LMCache / ours, the plugin's path)",
                  t["store_s"] / o["store_s"], t["load_s"] / o["load_s"],
                  t["lookup_ms"] / o["lookup_ms"], "", "", "")  # fmt: skip
    else:
        table.add(f"LMCache {peer.LMCACHE_VERSION}", "unavailable", "", "", "", "", unavailable)
    rpc_ms = median([x.empty_lookup_ms_p50 for x in ours])
    table.notes.append(
        f"A Lookup of no hashes (the bare gRPC round trip) took {rpc_ms:.2f} ms p50."
    )
    table.notes.append(
        f"Shape: {peer.SHAPE_SPEC} (32 KiB per token), {p.lmcache_tokens}-token requests "
        f"of which the full 256-token chunks are moved. LMCache: `lmcache bench server "
        "--mode cpu --transfer-mode engine_driven`, per-call p50 from its JSON (cold STORE, "
        "warm RETRIEVE, warm LOOKUP + prefetch-status poll); its pool allocated and faulted "
        "in after start-up (posix_fallocate + MADV_POPULATE_WRITE, like our --prefault sync). "
        "Ours: the same sequence per request (lookup, "
        "prepare_store + copies + commit_store, lookup, prepare_load + copies + "
        "release_load) through CacheClient, p50 per call. GB/s = call bytes / p50 call time."
    )


def _ours_medians(ours: list[OursRun]) -> dict[str, Any]:
    """``lookup_ms``: the plugin's lookup (from the shm index when the run timed it)."""
    grpc_ms = median([o.lookup_ms_p50 for o in ours])
    index = [o.index_lookup_ms_p50 for o in ours if o.index_lookup_ms_p50 is not None]
    index_ms = median(index) if index else None
    return {
        "store_s": median([o.store_s_p50 for o in ours]),
        "load_s": median([o.load_s_p50 for o in ours]),
        "grpc_lookup_ms": grpc_ms,
        "index_lookup_ms": index_ms,
        "lookup_ms": index_ms if index_ms is not None else grpc_ms,
    }


def _peer_medians(theirs: list[peer.PeerRun]) -> dict[str, float]:
    return {
        "store_s": median([t.store_ms_p50 for t in theirs]) / 1e3,
        "load_s": median([t.retrieve_ms_p50 for t in theirs]) / 1e3,
        "lookup_ms": median([t.lookup_ms_p50 for t in theirs]),
    }


# -- targets and plot ------------------------------------------------------------------------


def _targets(
    report: Report,
    p: Params,
    sweep: Sweep,
    ours: list[OursRun],
    theirs: list[peer.PeerRun],
) -> None:
    rpc_ms = median([x.empty_lookup_ms_p50 for x in ours])
    w8 = Workload(8 * MiB, p.total_mib * MiB, p.request_mib * MiB)
    copies = sweep.gbps[COPY][8]
    waits = {
        "store": f"one prepare_store round trip per {p.request_mib} MiB request before its "
        f"copies (a bare gRPC call took {rpc_ms:.2f} ms in this run, ~{{share:.0%}} of the "
        "path's time)",
        "pooled store": "no round trip waits before the copies (slots come from the pool, "
        "which keeps two requests' worth; the bind and the refill run on other threads, the "
        "last bind is waited for)",
        "load": f"one prepare_load round trip per {p.request_mib} MiB request (a bare gRPC "
        f"call took {rpc_ms:.2f} ms in this run, ~{{share:.0%}} of the path's time)",
    }
    checksums = (
        "the server's checksums wait until no commit came for tuning.checksum_quiet_s, or a "
        "chunk waited checksum_max_delay_s"
    )
    beside = {
        "store": f"the commits on the I/O thread, other processes; {checksums}",
        "pooled store": f"the binds and refills on the other threads, other processes; {checksums}",
        "load": "the releases on the I/O thread, other processes",
    }
    paths = (  # the plugin's default first: its store pool is off (tuning.store_pool_chunks 0)
        ("shm store (prepare per request)", "store", "the plugin's default path"),
        ("shm store", "pooled store", "plugin store_pool_chunks > 0"),
        ("shm load", "load", "the plugin's path"),
    )
    for name, label, which in paths:
        path_s = w8.moved_bytes / (sweep.median(name, 8) * 1e9)
        share = rpc_ms / 1e3 * w8.num_requests / path_s
        report.target(
            f"shm {label} vs same-run copy, 8 MiB chunks ({which})",
            sweep.median_ratio(name, 8), 0.9,
            why_missed=waits[label].format(share=share) + "; the rest is the copies "
            f"themselves, slowed by what runs beside them on 2 vCPUs ({beside[label]}): the "
            f"paired copies ran at {min(copies):.1f}-{max(copies):.1f} GB/s in this run, "
            f"{p.rounds} round(s)",
        )  # fmt: skip
    if not theirs:
        return
    o, t = _ours_medians(ours), _peer_medians(theirs)
    call = peer.call_bytes(p.lmcache_tokens)
    copy = median(copies)
    for label, key in (("store", "store_s"), ("retrieve", "load_s")):
        needed = 3 * gbps(call, t[key])
        report.target(
            f"{label} vs LMCache engine-driven (x)", t[key] / o[key], 3.0,
            why_missed=f"3x LMCache's {label} would be {needed:.1f} GB/s, {needed / copy:.0%} "
            f"of this run's median copy ({copy:.1f} GB/s); ours ran at "
            f"{gbps(call, o[key]):.1f} GB/s, serial calls with the round trips in them: the "
            "copy bounds both servers",
        )  # fmt: skip
    rpc_ms = median([x.empty_lookup_ms_p50 for x in ours])
    report.target(
        "lookup p50: LMCache / ours (x)", t["lookup_ms"] / o["lookup_ms"], 5.0,
        why_missed=f"our lookup took {o['lookup_ms']:.3f} ms p50 (from the shm index: "
        f"{o['index_lookup_ms']}; a gRPC Lookup {o['grpc_lookup_ms']:.2f} ms, a Lookup of no "
        f"hashes {rpc_ms:.2f} ms); LMCache's lookup is two ZMQ round trips (LOOKUP + "
        f"prefetch-status poll) at {t['lookup_ms']:.2f} ms",
    )  # fmt: skip


def _plot(ctx: BenchContext, report: Report, sweep: Sweep) -> None:
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    path = plots.lines(
        ctx.out_dir / "dataplane_throughput.png",
        "lmcache-svc data plane: throughput vs chunk size",
        list(SIZES_MIB),
        {name: [sweep.median(name, s) for s in SIZES_MIB] for name in PATHS},
        "chunk size (MiB)",
        "GB/s",
        baselines={COPY: [sweep.median(COPY, s) for s in SIZES_MIB]},
        logx=True,
    )
    if path is not None:
        report.plots.append(str(path))

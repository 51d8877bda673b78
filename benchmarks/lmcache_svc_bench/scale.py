"""``bench scale``: server memory per indexed chunk, load time vs prefix length, lookup vs size.

Memory: the server's private memory from ``/proc/PID/smaps``, the sum of ``Private_Clean``
and ``Private_Dirty`` over every mapping except the shared-memory arena (whose pages are the
payloads, and which this benchmark never touches anyway: chunks are indexed the way
``bench lookup`` does, 4 KiB chunks reserved and committed with their payload unwritten).
Private pages are what the process alone costs the machine; the arena is excluded because
it is payload, not index. The index grows in steps; the per-chunk figure is the growth from
the first step (1,000 chunks, which also warms the gRPC paths) divided by the chunks added.
Next to it, the same index built in this process under ``tracemalloc`` (Python allocations
only, exact, with the source line of each allocation: where the bytes go).

Load: chunks of 8 MiB (2 MiB in quick mode) stored through shared memory in a pre-faulted
arena, then for each prefix length ``prepare_load`` + a copy of every leased buffer into one
pre-touched destination + ``release_load``; the baseline copies the same bytes from a
pre-touched source into the same destination with the same numpy copy.

Lookup vs index size: p50/p99 of a 128-chunk full-hit lookup at each step, server-side (an
in-process cache with the same index) and round trip over the Unix socket.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

from lmcache_svc.cache import TieredCache
from lmcache_svc.client import CacheClient
from lmcache_svc.keys import KVLayout, Namespace, chunk_hashes
from lmcache_svc_bench import plots
from lmcache_svc_bench.lookup import (
    Clients,
    Latency,
    arena_bytes,
    check_indexed,
    fill_cache,
    inprocess_cache,
    prompt_hashes,
    start_index_only_server,
    time_calls,
    tiny_namespace,
)
from lmcache_svc_bench.procs import start_server
from lmcache_svc_bench.report import Report
from lmcache_svc_bench.runner import BenchContext
from lmcache_svc_bench.stats import gbps, median, ms

TARGET_BYTES_PER_CHUNK = 300


def private_bytes(pid: int, exclude_prefix: str = "/dev/shm/") -> int:
    """Private_Clean + Private_Dirty of ``pid`` over mappings not under ``exclude_prefix``."""
    total = 0
    excluded = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if not head.endswith(":"):  # a mapping's header line: "start-end perms ... path"
            parts = line.split(maxsplit=5)
            excluded = len(parts) == 6 and parts[5].startswith(exclude_prefix)
        elif head in ("Private_Clean:", "Private_Dirty:") and not excluded:
            total += int(line.split()[1]) * 1024
    return total


def run(ctx: BenchContext) -> Report:
    steps = [10**3, 10**4, 10**5] if ctx.quick else [10**3, 10**4, 10**5, 10**6]
    steps = [int(s) for s in str(ctx.option("steps", ",".join(map(str, steps)))).split(",")]
    if len(steps) < 2 or steps != sorted(steps) or steps[0] < 256:
        raise ValueError(f"steps must be at least two ascending sizes >= 256, got {steps}")
    report = ctx.report()
    ctx.out_dir.mkdir(parents=True, exist_ok=True)  # plots are written before the report
    _index_scale(ctx, report, steps)
    _tracemalloc_view(ctx, report, min(steps[-1], ctx.option("tracemalloc_chunks", 10**5)))
    _load_scale(ctx, report)
    return report


# -- memory and lookup against index size ----------------------------------------------------


def _index_scale(ctx: BenchContext, report: Report, steps: list[int]) -> None:
    ns = tiny_namespace("bench-scale")
    capacity = arena_bytes(steps[-1])
    iters = ctx.option("iters", 300 if ctx.quick else 3000)
    server = start_index_only_server(ctx.work_dir, capacity)
    clients: Clients | None = None
    rows: list[dict[str, Any]] = []
    try:
        clients = Clients.open(server, ns)
        with inprocess_cache(capacity) as cache:
            cache.register_namespace(ns)
            filled = 0
            for size in steps:
                ctx.progress(f"indexing {filled:,} -> {size:,} chunks")
                clients.filler.fill(ns.namespace_id, filled, size)
                check_indexed(clients.socket, size)
                fill_cache(cache, ns.namespace_id, filled, size)
                filled = size
                time.sleep(0.2)  # let the server's maintenance settle before reading memory
                row = _measure_step(cache, clients.socket, ns.namespace_id, size, iters)
                rows.append({**row, "private_bytes": private_bytes(server.proc.pid)})
    finally:
        if clients is not None:
            clients.close()
        server.stop()
        server.cleanup()
    report.data["index_steps"] = rows
    _memory_table(report, rows)
    _lookup_table(ctx, report, rows)


def _measure_step(
    cache: TieredCache, socket: CacheClient, ns_id: bytes, size: int, iters: int
) -> dict[str, Any]:
    hashes = prompt_hashes("full hit", size)
    return {
        "chunks": size,
        "server_side": time_calls(lambda: cache.lookup(ns_id, hashes), iters),
        "socket": time_calls(lambda: socket.lookup(ns_id, hashes), iters),
    }


def _memory_table(report: Report, rows: list[dict[str, Any]]) -> None:
    table = report.table(
        "Server memory per indexed chunk (beyond its payload)",
        [
            "chunks indexed",
            "server private MiB",
            "added since first step",
            "bytes per chunk since first step",
            "bytes per chunk since previous step",
        ],
    )
    base = rows[0]
    per_chunk = 0.0
    for prev, row in zip([None, *rows], rows):
        added = row["chunks"] - base["chunks"]
        per_chunk = (row["private_bytes"] - base["private_bytes"]) / added if added else 0.0
        marginal = _growth_per_chunk(prev, row) if prev is not None else None
        row["bytes_per_chunk"] = per_chunk if added else None
        row["marginal_bytes_per_chunk"] = marginal
        table.add(
            f"{row['chunks']:,}",
            row["private_bytes"] / 2**20,
            f"{added:,}",
            per_chunk if added else "-",
            "-" if marginal is None else marginal,
        )
    table.notes += [
        "private memory: Private_Clean + Private_Dirty of the server process in "
        "/proc/PID/smaps, the shared-memory arena (payloads) excluded",
        "chunks of 4 KiB (smallest slab class) indexed by prepare + commit; "
        "bytes per chunk = memory growth / chunks added; 'since first step' also carries "
        "one-off costs of the first big batches (gRPC buffers, allocator pools), which the "
        "'since previous step' column leaves out; the target uses the first",
    ]
    report.target(
        f"server memory per indexed chunk at {rows[-1]['chunks']:,} chunks",
        per_chunk,
        TARGET_BYTES_PER_CHUNK,
        unit=" B",
        lower_is_better=True,
        timing=False,
        why_missed=f"{rows[-1]['marginal_bytes_per_chunk']:.0f} B per chunk since the previous "
        "step: the rest is one-off memory of the first batches, which weighs less the more "
        "chunks are indexed; per-chunk objects in 'where the bytes go'",
    )


def _growth_per_chunk(prev: dict[str, Any], row: dict[str, Any]) -> float:
    return (row["private_bytes"] - prev["private_bytes"]) / (row["chunks"] - prev["chunks"])


def _lookup_table(ctx: BenchContext, report: Report, rows: list[dict[str, Any]]) -> None:
    table = report.table(
        "Lookup of a 128-chunk full hit against index size",
        [
            "chunks indexed",
            "server-side p50 ms",
            "p99 ms",
            "p99 on-CPU ms",
            "unix socket p50 ms",
            "p99 ms",
        ],
    )
    for row in rows:
        server: Latency = row["server_side"]
        socket: Latency = row["socket"]
        table.add(
            f"{row['chunks']:,}",
            server.p50_ms,
            server.p99_ms,
            server.cpu_p99_ms,
            socket.p50_ms,
            socket.p99_ms,
        )
    table.notes.append(
        "server-side: TieredCache.lookup on an in-process cache with the same index; "
        "see `bench lookup` for misses, TCP, REST and the baselines"
    )
    xs = [float(r["chunks"]) for r in rows]
    path = plots.lines(
        ctx.out_dir / "scale_lookup.png",
        "Lookup of 128 chunks vs index size",
        xs,
        {
            "server-side p50": [r["server_side"].p50_ms for r in rows],
            "server-side p99": [r["server_side"].p99_ms for r in rows],
            "unix socket p50": [r["socket"].p50_ms for r in rows],
            "unix socket p99": [r["socket"].p99_ms for r in rows],
        },
        "chunks indexed",
        "ms",
        logx=True,
    )
    if path is not None:
        report.plots.append(str(path))


def _tracemalloc_view(ctx: BenchContext, report: Report, num_chunks: int) -> None:
    """The same index built in this process under tracemalloc: bytes per chunk by line."""
    ctx.progress(f"tracemalloc: indexing {num_chunks:,} chunks in this process")
    ns = tiny_namespace("bench-scale-tracemalloc")
    warm = 1000
    with inprocess_cache(arena_bytes(num_chunks + warm)) as cache:
        cache.register_namespace(ns)
        fill_cache(cache, ns.namespace_id, 0, warm)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            fill_cache(cache, ns.namespace_id, warm, warm + num_chunks)
            gc.collect()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
    diffs = after.compare_to(before, "lineno")
    total = sum(d.size_diff for d in diffs) / num_chunks
    table = report.table(
        f"Where the bytes go: tracemalloc, {num_chunks:,} chunks indexed in-process",
        ["allocated at", "bytes per chunk"],
    )
    top = sorted(diffs, key=lambda d: -d.size_diff)[:6]
    for d in top:
        frame = d.traceback[0]
        table.add(f"{Path(frame.filename).name}:{frame.lineno}", d.size_diff / num_chunks)
    table.add("total (all lines)", total)
    table.notes.append(
        "Python allocations only (requested sizes, no allocator rounding); the server figure "
        "above is the process's real private memory"
    )
    report.data["tracemalloc_bytes_per_chunk"] = total


# -- load time against prefix length ---------------------------------------------------------


def _load_scale(ctx: BenchContext, report: Report) -> None:
    num_layers = ctx.option("load_layers", 2 if ctx.quick else 8)  # 4 KiB per token per layer
    lengths = [1, 4, 16, 64] if ctx.quick else [1, 4, 16, 64, 128]
    reps = ctx.option("reps", 5 if ctx.quick else 10)
    layout = KVLayout("bfloat16", num_layers, 8, 128, 256, "bench/scale")
    ns = Namespace(model="bench-scale-load", layout=layout, chunk_size=256)
    chunk = ns.chunk_bytes
    total = chunk * lengths[-1]
    ctx.progress(f"load vs prefix: {lengths[-1]} chunks of {chunk / 2**20:.0f} MiB")
    server = start_server(
        ctx.work_dir,
        "--cpu-bytes",
        str(total + 4 * chunk + 64 * 2**20),
        "--prefault",
        "sync",
        # the only client stores the whole prefix in one call: let it reserve the arena
        env={"LMCACHE_SVC_CACHE__MAX_RESERVED_FRACTION": "1.0"},
        timeout_s=120.0,
    )
    try:
        with CacheClient(server.socket, timeout_s=120.0) as client:
            rows = _time_loads(ctx, client, ns, lengths, reps)
    finally:
        server.stop()
        server.cleanup()
    _load_table(ctx, report, rows, chunk)


def _time_loads(
    ctx: BenchContext, client: CacheClient, ns: Namespace, lengths: list[int], reps: int
) -> list[dict[str, Any]]:
    ns_id = client.register_namespace(ns)
    chunk = ns.chunk_bytes
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, size=chunk * lengths[-1], dtype=np.uint8)
    dest = np.ones_like(source)  # touched
    hashes: list[bytes] = list(chunk_hashes(ns, list(range(256 * lengths[-1]))))
    buffers = [source[i * chunk : (i + 1) * chunk] for i in range(lengths[-1])]
    if client.store(ns_id, hashes, buffers) != len(hashes):
        raise RuntimeError("the server did not store every chunk of the load test")
    small_pages = mmap.mmap(-1, source.nbytes)  # anonymous, 4 KiB pages like the segment
    try:
        return _time_prefixes(ctx, client, ns_id, hashes, source, small_pages, dest, lengths, reps)
    finally:
        with contextlib.suppress(BufferError):  # a view still alive after an error: GC frees it
            small_pages.close()


def _time_prefixes(
    ctx: BenchContext,
    client: CacheClient,
    ns_id: bytes,
    hashes: list[bytes],
    source: np.ndarray,
    small_pages: mmap.mmap,
    dest: np.ndarray,
    lengths: list[int],
    reps: int,
) -> list[dict[str, Any]]:
    chunk = source.nbytes // lengths[-1]
    small = np.frombuffer(small_pages, dtype=np.uint8)
    small[:] = source
    rows: list[dict[str, Any]] = []
    for num in lengths:
        ctx.progress(f"load of a {num}-chunk prefix x {reps}")
        n = num * chunk
        times: dict[str, list[float]] = {"shm_s": [], "copy_s": [], "copy_4k_s": [], "rpc_s": []}
        for _ in range(reps + 1):  # the first round warms up and is dropped
            times["shm_s"].append(_shm_load(client, ns_id, hashes[:num], dest, chunk))
            times["copy_s"].append(_copy(source[:n], dest[:n]))
            times["copy_4k_s"].append(_copy(small[:n], dest[:n]))
            t0 = time.perf_counter()
            client.stats()
            times["rpc_s"].append(time.perf_counter() - t0)
        _shm_load(client, ns_id, hashes[:num], dest, chunk)
        if not np.array_equal(dest[:n], source[:n]):
            raise RuntimeError(f"loaded bytes differ from the stored ones ({num} chunks)")
        rows.append({"chunks": num, **{k: median(v[1:]) for k, v in times.items()}})
    del small
    return rows


def _shm_load(
    client: CacheClient, ns_id: bytes, hashes: list[bytes], dest: np.ndarray, chunk: int
) -> float:
    t0 = time.perf_counter()
    lease = client.prepare_load(ns_id, hashes)
    try:
        if len(lease.buffers) != len(hashes):
            raise RuntimeError(f"leased {len(lease.buffers)} of {len(hashes)} chunks")
        for i, buf in enumerate(lease.buffers):
            np.copyto(dest[i * chunk : (i + 1) * chunk], np.frombuffer(buf, dtype=np.uint8))
    finally:
        client.release_load(lease)
    return time.perf_counter() - t0


def _copy(source: np.ndarray, dest: np.ndarray) -> float:
    t0 = time.perf_counter()
    np.copyto(dest, source)
    return time.perf_counter() - t0


def _load_table(ctx: BenchContext, report: Report, rows: list[dict[str, Any]], chunk: int) -> None:
    table = report.table(
        f"Load time vs prefix length ({chunk / 2**20:.0f} MiB chunks, shared memory)",
        [
            "prefix chunks",
            "load ms",
            "load GB/s",
            "copy ms",
            "copy GB/s",
            "copy from 4 KiB pages ms",
            "bare RPC ms",
            "load / copy time",
            "load / 4 KiB-page copy time",
        ],
    )
    for row in rows:
        nbytes = row["chunks"] * chunk
        table.add(
            row["chunks"],
            ms(row["shm_s"]),
            gbps(nbytes, row["shm_s"]),
            ms(row["copy_s"]),
            gbps(nbytes, row["copy_s"]),
            ms(row["copy_4k_s"]),
            ms(row["rpc_s"]),
            row["shm_s"] / row["copy_s"],
            row["shm_s"] / row["copy_4k_s"],
        )
    table.notes += [
        "load = prepare_load + numpy copy of each leased buffer into a pre-touched "
        "destination + release_load (CacheClient over the Unix socket, arena pre-faulted)",
        "copy = the same numpy copy of the same bytes from a pre-touched numpy source, same "
        "run (numpy backs large arrays with transparent huge pages); copy from 4 KiB pages = "
        "the same copy from an anonymous mmap, whose 4 KiB pages are what the shared "
        "segment gets where /sys/kernel/mm/transparent_hugepage/shmem_enabled is never",
        "bare RPC = one Stats call on the same client: a load costs two round trips "
        "(prepare_load, release_load) on top of its copies",
        "median of the timed rounds; bytes checked equal after each length",
    ]
    report.data["load"] = rows
    path = plots.lines(
        ctx.out_dir / "scale_load.png",
        "Load time vs prefix length",
        [float(r["chunks"]) for r in rows],
        {"shared-memory load": [ms(r["shm_s"]) for r in rows]},
        "prefix length (chunks)",
        "ms",
        baselines={
            "copy of the same bytes": [ms(r["copy_s"]) for r in rows],
            "copy from 4 KiB pages": [ms(r["copy_4k_s"]) for r in rows],
        },
        logx=True,
    )
    if path is not None:
        report.plots.append(str(path))

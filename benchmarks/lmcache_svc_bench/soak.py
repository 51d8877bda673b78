"""``bench soak``: clients storing, loading and looking up while faults are injected.

A real server (64 MiB arena so chunks are evicted, demoted to SSD and promoted back; an SSD
tier; a Redis tier on a redis-server the run starts itself) serves ``clients`` worker
processes (``soak_worker.py``: shared-memory and inline gRPC clients, every chunk's bytes a
pattern of its hash, every load verified on the spot). The run is split into equal phases:

Each client mixes stores, loads, lookups and deletes (3:4:2:1; deletes keep stores writing
new chunks once the key space has been stored).

- ``steady``: traffic only;
- ``client-kill``: store-only clients SIGKILLed every 1.5-3 s, mostly mid-store;
- ``redis-outage``: redis-server SIGSTOPped (hung), resumed, then SIGKILLed and restarted
  empty;
- ``server-restart``: the server SIGKILLed and restarted, later SIGTERMed and restarted;
- ``recovered``: traffic only, after every fault.

Two more workers (one over gRPC, one over REST) store, read, list and delete named memories
the whole time, every byte of every read verified, while a byte of a random memory file is
flipped on disk every few seconds and files that are not memories are planted before the
server restarts (``soak_memories.py``): a corrupted memory must be refused, never served.

At the end one client loads every chunk of the key space it can find and checks it too
(``final``), every memory the server lists is read and checked, and the server must hold no
reservation of the killed clients. The report
gives operations, errors, bytes verified and mismatches per phase, and RSS over time. Any
mismatch (of a chunk or a memory) misses its target and makes ``lmcache-svc bench soak`` exit
non-zero (``report.data["failed"]``).

``--minutes N`` (or ``--set minutes=N``) sets the length; ``--set`` keys: ``clients``,
``key_space`` (prefixes of 4 chunks), ``max_ops`` (per client). Loopback only; stops by itself.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache_svc.client import CacheClient
from lmcache_svc_bench.report import Report
from lmcache_svc_bench.runner import BenchContext
from lmcache_svc_bench.soak_faults import SoakStack, Victims, spawn_worker
from lmcache_svc_bench.soak_memories import MemoryFaults, final_memory_check
from lmcache_svc_bench.soak_report import memory_table
from lmcache_svc_bench.soak_worker import content, prefix_hashes, soak_namespace

PHASES = ("steady", "client-kill", "redis-outage", "server-restart", "recovered")
MEMORY_KEYS = 24
"""Named memories the memory workers use (64-320 KiB each)."""
OPS = ("store", "load", "lookup", "delete")
COLUMNS = ["phase", "s", "stores", "loads", "lookups", "deletes", "errors", "MiB verified",
           "mismatches"]  # fmt: skip


@dataclass(frozen=True)
class Params:
    minutes: float
    clients: int
    key_space: int
    max_ops: int

    def check(self) -> None:
        if not 0.25 <= self.minutes <= 24 * 60:
            raise ValueError(f"minutes must be between 0.25 and 1440, got {self.minutes}")
        if not 2 <= self.clients <= 32 or self.key_space < 8 or self.max_ops < 1:
            raise ValueError("need 2 <= clients <= 32, key_space >= 8, max_ops >= 1")


def params(ctx: BenchContext) -> Params:
    p = Params(
        minutes=ctx.option("minutes", 1.0 if ctx.quick else 10.0),
        clients=ctx.option("clients", 3),
        key_space=ctx.option("key_space", 600),
        max_ops=ctx.option("max_ops", 1_000_000),
    )
    p.check()
    return p


def run(ctx: BenchContext) -> Report:
    p = params(ctx)
    phase_s = p.minutes * 60 / len(PHASES)
    out_dir = ctx.work_dir / "clients"
    out_dir.mkdir()
    stack = SoakStack(ctx.work_dir)
    workers: list[Any] = []
    samples: list[tuple[float, int, int]] = []
    stop_sampling = threading.Event()
    try:
        start = time.time()
        until = start + len(PHASES) * phase_s + 600  # a backstop: the stop file ends them
        stop_file = ctx.work_dir / "stop"
        for i in range(p.clients):  # the first shares memory, the second is inline, ...
            inline = i % 2 == 1
            address = stack.tcp_address if inline else stack.socket
            out = out_dir / f"client-{i}.json"
            workers.append(spawn_worker(address, out, until, inline=inline,
                                        key_space=p.key_space, max_ops=p.max_ops,
                                        stop_file=stop_file))  # fmt: skip
        for transport in ("grpc", "rest"):
            out = out_dir / f"memories-{transport}.json"
            workers.append(spawn_worker(stack.socket, out, until, memories=transport,
                                        http_url=stack.http_url, stop_file=stop_file))  # fmt: skip
        _wait_started(out_dir, len(workers), workers)
        faults = MemoryFaults(stack.memory_dir, stack.events)
        faults.start()
        sampler = threading.Thread(
            target=_sample, args=(stack, samples, stop_sampling), daemon=True
        )
        sampler.start()
        start = time.time()  # the phases start once every worker runs
        bounds = _run_phases(ctx, stack, phase_s, out_dir, until, p.key_space, faults)
        stop_file.touch()
        for proc in workers:
            _reap(proc, deadline=time.time() + 60)
        faults.stop()
        final = _final_check(stack, p.key_space)
        memories_final = final_memory_check(stack.socket, MEMORY_KEYS)
        pending = int(_stats(stack)["pending_stores"])
        stop_sampling.set()
        sampler.join(5)
    finally:
        stop_sampling.set()
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
        stack.close()
    totals = _collect(out_dir, bounds)
    totals["final"] = final
    totals["memories_final"] = {**memories_final, "files_corrupted": faults.corrupted}
    return _report(ctx, p, start, bounds, totals, samples, stack, pending)


def _run_phases(
    ctx: BenchContext, stack: SoakStack, phase_s: float, out_dir: Path, until: float, keys: int,
    faults: MemoryFaults,
) -> dict[str, tuple[float, float]]:  # fmt: skip
    bounds: dict[str, tuple[float, float]] = {}
    victims = Victims(stack, out_dir, until, keys, stop_file=out_dir.parent / "stop")
    steps = {
        "steady": lambda: time.sleep(phase_s),
        "client-kill": lambda: victims.run_for(phase_s),
        "redis-outage": lambda: _redis_outage(stack, phase_s),
        "server-restart": lambda: _server_restarts(stack, phase_s, faults),
        "recovered": lambda: time.sleep(phase_s),
    }
    for name in PHASES:
        ctx.progress(f"phase {name} ({phase_s:.0f} s)")
        began = time.time()
        steps[name]()
        bounds[name] = (began, time.time())
    return bounds


def _wait_started(out_dir: Path, num: int, procs: list[Any], timeout_s: float = 120) -> None:
    """Until every worker has written its first counts (it imported, connected and runs):
    on a busy machine starting them all takes longer than a quick run's first phase."""
    deadline = time.monotonic() + timeout_s
    while len(list(out_dir.glob("*.json"))) < num:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"soak workers did not start; see the logs in {out_dir}")
        time.sleep(0.1)


def _redis_outage(stack: SoakStack, phase_s: float) -> None:
    plan = ((0.1, stack.hang_redis), (0.35, stack.resume_redis), (0.5, stack.kill_redis),
            (0.65, stack.restart_redis), (1.0, lambda: None))  # fmt: skip
    _on_schedule(plan, phase_s)


def _server_restarts(stack: SoakStack, phase_s: float, faults: MemoryFaults) -> None:
    def plant() -> None:  # the restart must skip them, and start
        planted = faults.plant_bad_files()
        stack.events.append((time.time(), f"bad memory files planted ({planted})"))

    plan = ((0.1, plant), (0.15, stack.crash_server), (0.25, stack.restart_server),
            (0.55, stack.stop_server), (0.6, stack.restart_server),
            (1.0, lambda: None))  # fmt: skip
    _on_schedule(plan, phase_s)


def _on_schedule(plan: Any, phase_s: float) -> None:
    began = time.monotonic()
    for at, action in plan:
        time.sleep(max(0.0, began + at * phase_s - time.monotonic()))
        action()


def _sample(stack: SoakStack, samples: list[tuple[float, int, int]], stop: threading.Event) -> None:
    while not stop.wait(1.0):
        server, redis = stack.rss()
        samples.append((time.time(), server, redis))


def _reap(proc: Any, deadline: float) -> None:
    try:
        proc.wait(max(1.0, deadline - time.time()))
    except Exception:
        proc.kill()
        proc.wait()


def _stats(stack: SoakStack) -> dict[str, Any]:
    with CacheClient(stack.socket, timeout_s=30, use_shm=False) as c:
        return c.stats()


def _final_check(stack: SoakStack, key_space: int) -> dict[str, int]:
    """Load every prefix of the key space and verify what comes back."""
    ns = soak_namespace()
    found = verified = mismatches = 0
    with CacheClient(stack.socket, timeout_s=30) as c:
        ns_id = c.register_namespace(ns)
        for prefix in range(key_space):
            hashes = prefix_hashes(ns, prefix)
            for h, chunk in zip(hashes, c.load(ns_id, hashes)):
                found += 1
                if chunk == content(h, ns.chunk_bytes):
                    verified += len(chunk)
                else:
                    mismatches += 1
    return {"chunks": found, "bytes_verified": verified, "mismatches": mismatches}


def _collect(out_dir: Path, bounds: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Sum the clients' per-second counts into the phase each second fell in."""
    phases: dict[str, Counter[str]] = {name: Counter() for name in PHASES}
    mismatched: list[str] = []
    files = 0
    for path in sorted(out_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a victim killed before its first write
        files += 1
        mismatched += data.get("mismatched", [])
        for second, counts in data["seconds"].items():
            name = _phase_of(int(second) + 0.5, bounds)
            phases[name].update(counts)
    return {"phases": {k: dict(v) for k, v in phases.items()}, "mismatched": mismatched,
            "client_files": files}  # fmt: skip


def _phase_of(t: float, bounds: dict[str, tuple[float, float]]) -> str:
    for name, (began, ended) in bounds.items():
        if began <= t < ended:
            return name
    return PHASES[0] if t < bounds[PHASES[0]][0] else PHASES[-1]


def _report(
    ctx: BenchContext, p: Params, start: float, bounds: dict[str, tuple[float, float]],
    totals: dict[str, Any], samples: list[tuple[float, int, int]], stack: SoakStack,
    pending: int,
) -> Report:  # fmt: skip
    report = ctx.report()
    table = report.table(
        f"Operations per phase ({p.clients} clients, {p.minutes:g} min, key space "
        f"{p.key_space} x 4 chunks of 64 KiB)",
        COLUMNS,
    )
    mismatches = totals["final"]["mismatches"]
    errors_by_kind: Counter[str] = Counter()
    for name in PHASES:
        counts = totals["phases"][name]
        errors = {k[6:]: v for k, v in counts.items() if k.startswith("error:")}
        errors_by_kind.update(errors)
        mismatches += counts.get("mismatches", 0)
        began, ended = bounds[name]
        table.add(name, round(ended - began), *(counts.get(op, 0) for op in OPS),
                  sum(errors.values()), counts.get("bytes_verified", 0) / 2**20,
                  counts.get("mismatches", 0))  # fmt: skip
    final = totals["final"]
    table.add("final check", "", 0, final["chunks"], 0, 0, 0, final["bytes_verified"] / 2**20,
              final["mismatches"])  # fmt: skip
    table.notes += [
        "errors by kind: " + (", ".join(f"{k} {v}" for k, v in errors_by_kind.most_common())
                              or "none"),
        f"faults: {_fault_summary(stack.events)}",
        f"reservations left pending after the run: {pending}",
    ]  # fmt: skip
    _rss_table(report, start, samples, bounds)
    report.target(
        "chunks served with wrong bytes", mismatches, 0, lower_is_better=True, timing=False
    )
    memory_mismatches, memory_verified = memory_table(report, PHASES, bounds, totals)
    report.target(
        "memories served with wrong bytes",
        memory_mismatches,
        0,
        lower_is_better=True,
        timing=False,
    )
    idle = [n for n in PHASES if not sum(totals["phases"][n].get(op, 0) for op in OPS)]
    report.data.update(
        params=p.__dict__, bounds=bounds, totals=totals, events=stack.events,
        rss=samples, pending_stores=pending, mismatches=mismatches, idle_phases=idle,
        memory_mismatches=memory_mismatches,
        failed=bool(mismatches or idle or pending or memory_mismatches or not memory_verified),
    )  # fmt: skip
    return report


def _fault_summary(events: list[tuple[float, str]]) -> str:
    counts = Counter(what for _, what in events)
    return ", ".join(f"{what} x{n}" for what, n in counts.items()) or "none"


def _rss_table(
    report: Report, start: float, samples: list[tuple[float, int, int]],
    bounds: dict[str, tuple[float, float]],
) -> None:  # fmt: skip
    table = report.table("RSS over time", ["t (s)", "phase", "server MiB", "redis MiB"])
    step = max(1, len(samples) // 15)
    for t, server, redis in samples[::step]:
        table.add(round(t - start), _phase_of(t, bounds), server / 2**20, redis / 2**20)
    if samples:
        peak = max(s for _, s, _ in samples)
        table.notes.append(f"server peak RSS {peak / 2**20:.0f} MiB (0 = restarting)")

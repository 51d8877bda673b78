"""The Redis half of ``bench tiers``: ``RedisTier`` SET/GET throughput next to baselines.

A throwaway ``redis-server`` (loopback, a free port, no RDB or AOF) is started for the run.
Per value size and round, in a rotated order:

- ``redis-benchmark -c C -n N -d SIZE -t set`` then ``-t get``, ``--csv`` (requests/s x
  SIZE), with ``-r`` so that it writes as many keys as the others do (its default, one key
  rewritten over and over, keeps the value's memory hot in the CPU cache).
- a naive redis-py loop on one connection: ``r.set(key, value)`` per value, then
  ``r.get(key)`` per value (the reply is dropped, not copied anywhere).
- ``RedisTier(num_connections=C)``: ``put_many`` then ``read_many_into`` over batches of
  ``batch_bytes``, reading into page-aligned buffers; the bytes read back are compared
  with those written (outside the timings).

Each SET phase starts from an empty database (``FLUSHALL``, not timed). The CPU time of
redis-server and of the client side (this process, or redis-benchmark) is recorded per phase,
to tell whether Redis or the client limits a figure.
"""

from __future__ import annotations

import csv
import io
import mmap
import os
import resource
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis

from lmcache_svc.keys import ChunkKey
from lmcache_svc.tiers.redis import RedisTier
from lmcache_svc_bench.redis_procs import RedisProc, start_redis
from lmcache_svc_bench.report import Progress
from lmcache_svc_bench.stats import gbps

PATHS = ("redis-benchmark", "naive redis-py", "RedisTier")
OPS = ("SET new", "SET overwrite", "GET")
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(slots=True)
class RedisParams:
    value_sizes: list[int]
    total_bytes: int
    connections: int
    batch_bytes: int
    rounds: int

    def num_values(self, size: int) -> int:
        return max(self.connections, self.total_bytes // size)


@dataclass(slots=True)
class Phase:
    """One timed phase: throughput and the CPU each side used during it (1.0 = one core)."""

    gbps: float
    server_cpu: float
    client_cpu: float


@dataclass
class RedisResults:
    params: RedisParams
    phases: dict[str, list[Phase]] = field(default_factory=dict)
    """``"<path> <op> <size>"`` -> each round's phase."""
    identical: bool = True
    server_version: str = ""

    def add(self, path: str, op: str, size: int, phase: Phase) -> None:
        self.phases.setdefault(f"{path} {op} {size}", []).append(phase)


def check_params(params: RedisParams) -> None:
    for tool in ("redis-server", "redis-benchmark"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is not on PATH: the Redis case needs it")
    if not params.value_sizes or min(params.value_sizes) <= 0:
        raise ValueError("redis value sizes must be positive")
    if params.connections < 1 or params.rounds < 1 or params.total_bytes <= 0:
        raise ValueError("redis connections, rounds and total must be positive")


def measure_redis(params: RedisParams, work_dir: Path, progress: Progress) -> RedisResults:
    check_params(params)
    results = RedisResults(params)
    server = RedisServer.start(work_dir)
    try:
        results.server_version = server.client.info("server").get("redis_version", "")
        for size in params.value_sizes:
            _measure_size(params, size, server, results, progress)
    finally:
        server.stop()
    return results


def _measure_size(
    params: RedisParams, size: int, server: RedisServer, results: RedisResults, progress: Progress
) -> None:
    num_values = params.num_values(size)
    per_batch = max(1, min(num_values, params.batch_bytes // size))
    src = _aligned(per_batch * size, fill=True)
    out = _aligned(per_batch * size, fill=False)
    tier = RedisTier(server.url, 4 * num_values * size, num_connections=params.connections)
    try:
        cases = _Cases(params, size, server, results, tier, src, out)
        runs: list[Callable[[], None]] = [cases.benchmark, cases.naive, cases.tier_rounds]
        for r in range(-1, params.rounds):  # round -1 warms up (allocators, connections)
            cases.record = r >= 0
            for i in range(len(runs)):
                runs[(r + i) % len(runs)]()
            if r >= 0:
                last = {
                    k.rsplit(" ", 1)[0]: f"{v[-1].gbps:.2f}"
                    for k, v in results.phases.items()
                    if k.endswith(f" {size}")
                }
                progress(f"redis {size / 2**20:g} MiB round {r + 1}/{params.rounds}: GB/s {last}")
    finally:
        tier.close()
        server.client.flushall()


class _Cases:
    def __init__(
        self,
        params: RedisParams,
        size: int,
        server: RedisServer,
        results: RedisResults,
        tier: RedisTier,
        src: mmap.mmap,
        out: mmap.mmap,
    ) -> None:
        self.params, self.size, self.server, self.results = params, size, server, results
        self.redis_tier = tier
        self.num_values = params.num_values(size)
        per_batch = len(src) // size
        self.src = [memoryview(src)[i * size : (i + 1) * size] for i in range(per_batch)]
        self.out = [memoryview(out)[i * size : (i + 1) * size] for i in range(per_batch)]
        self.keys = [ChunkKey(os.urandom(48)) for _ in range(self.num_values)]
        self.record = True

    @property
    def total(self) -> int:
        return self.num_values * self.size

    @contextmanager
    def _timed(self, path: str, op: str, *, children: bool = False) -> Iterator[list[float]]:
        """Times the block; a tool that reports its own rate puts bytes/s in the yielded list."""
        rate: list[float] = []
        with self.server.measure(children=children) as phase:
            yield rate
        if self.record:
            self.results.add(
                path, op, self.size, phase(rate[0], 1.0) if rate else phase(self.total)
            )

    def benchmark(self) -> None:
        """SET new: ``-r`` over a keyspace of 10^9 (keys are new). SET overwrite and GET: ``-r``
        over the ``num_values`` keys ``key:%012d`` it uses, written beforehand (not timed)."""
        self.server.client.flushall()
        self._run_benchmark("SET new", ["-t", "set", "-r", str(10**9)])
        self.server.client.flushall()
        pipe = self.server.client.pipeline(transaction=False)
        for i in range(self.num_values):
            pipe.set(f"key:{i:012d}", self.src[0])
        pipe.execute()
        keyspace = ["-r", str(self.num_values)]
        self._run_benchmark("SET overwrite", ["-t", "set", *keyspace])
        self._run_benchmark("GET", ["-t", "get", *keyspace])

    def _run_benchmark(self, op: str, args: list[str]) -> None:
        port, size = self.server.port, self.size
        with self._timed("redis-benchmark", op, children=True) as rate:
            rate.append(size * _redis_benchmark(port, self.params, size, self.num_values, args))

    def naive(self) -> None:
        self.server.client.flushall()
        client = redis.Redis(host="127.0.0.1", port=self.server.port)
        try:
            value = bytes(self.src[0])
            names = [f"naive:{i}" for i in range(self.num_values)]
            for op in ("SET new", "SET overwrite"):
                with self._timed("naive redis-py", op):
                    for name in names:
                        client.set(name, value)
            with self._timed("naive redis-py", "GET"):
                for name in names:
                    client.get(name)
        finally:
            client.close()

    def tier_rounds(self) -> None:
        self.server.client.flushall()
        n = len(self.src)
        batches = [list(enumerate(self.keys))[i : i + n] for i in range(0, self.num_values, n)]
        for view in self.out:
            view[:] = bytes(len(view))
        ok = True
        for op in ("SET new", "SET overwrite"):
            with self._timed("RedisTier", op):
                for batch in batches:
                    ok &= all(self.redis_tier.put_many([(k, self.src[i % n]) for i, k in batch]))
        with self._timed("RedisTier", "GET"):
            for batch in batches:
                ok &= all(self.redis_tier.read_many_into([(k, self.out[i % n]) for i, k in batch]))
        self.results.identical &= ok and all(map(_equal, self.out, self.src))


PhaseOf = Callable[..., Phase]


class RedisServer:
    """A throwaway redis-server (``redis_procs.start_redis``) with a client and CPU counters."""

    def __init__(self, proc: RedisProc) -> None:
        self.proc = proc
        self.port = proc.port
        self.client = redis.Redis(host="127.0.0.1", port=proc.port, socket_timeout=60)

    @property
    def url(self) -> str:
        return self.proc.url

    @classmethod
    def start(cls, work_dir: Path) -> RedisServer:
        return cls(start_redis(work_dir))

    def stop(self) -> None:
        self.client.close()
        self.proc.stop()

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime

    @contextmanager
    def measure(self, *, children: bool = False) -> Iterator[PhaseOf]:
        """Times the block; yields ``phase(num_bytes, seconds=None)`` to call after it.

        ``seconds`` overrides the wall time for rates a tool reports itself (``num_bytes``
        then is bytes per second and ``seconds`` 1.0); the CPU shares use the wall time."""
        marks: dict[str, float] = {}

        def phase(num_bytes: float, seconds: float | None = None) -> Phase:
            wall = marks["wall"]
            return Phase(
                gbps(num_bytes, seconds or wall), marks["server"] / wall, marks["client"] / wall
            )

        server, client, start = self.cpu_seconds(), _client_cpu(children), time.perf_counter()
        yield phase
        marks["wall"] = time.perf_counter() - start
        marks["server"] = self.cpu_seconds() - server
        marks["client"] = _client_cpu(children) - client


def _client_cpu(children: bool) -> float:
    if children:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime
    return time.process_time()


def _redis_benchmark(
    port: int, params: RedisParams, size: int, requests: int, extra: list[str]
) -> float:
    """Requests per second redis-benchmark reports for its one test (``-t set`` or ``get``)."""
    args = ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "--csv"]
    args += ["-c", str(params.connections), "-n", str(requests), "-d", str(size), *extra]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600, check=False)
    for row in csv.reader(io.StringIO(done.stdout)):
        if row and row[0] in ("SET", "GET"):
            return float(row[1])
    shown = " ".join(args[5:])
    raise RuntimeError(
        f"redis-benchmark {shown} gave no rate: {done.stdout[-500:]}{done.stderr[-500:]}"
    )


def _aligned(nbytes: int, *, fill: bool) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)
    array = np.frombuffer(buf, dtype=np.uint8)
    if fill:
        array[:] = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8)
    else:
        array[:] = 1  # touched, so page faults stay out of the timings
    return buf


def _equal(a: memoryview, b: memoryview) -> bool:
    return bool(np.array_equal(np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)))

"""The SSD half of ``bench tiers``: ``SsdTier`` write and read throughput next to ``dd``.

The tier is driven in-process through its public ``Tier`` contract with ``o_direct=True``,
from page-aligned buffers (as arena slots are): one ``put``/``read_into`` per chunk
("single"), and ``put_many``/``read_many_into`` over batches of chunks ("batched"). The
baseline is ``dd`` with ``oflag=direct``/``iflag=direct`` on the same directory, with the
block size equal to the chunk size and the same total bytes. The three are run in turn,
in a rotated order each round; the report gives the median of the rounds.

Reads come from the device: both sides use O_DIRECT (dropping the page cache needs root),
and the bytes the block layer fetched (``getrusage`` ``ru_inblock``, counted per process and
its waited-for children) are reported next to the bytes asked for.
"""

from __future__ import annotations

import mmap
import os
import re
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lmcache_svc.errors import ConfigError
from lmcache_svc.keys import ChunkKey
from lmcache_svc.tiers.ssd import SsdTier
from lmcache_svc_bench.report import Progress
from lmcache_svc_bench.stats import gbps

PATHS = ("dd", "tier single", "tier batched")
OPS = ("write", "read")
_DD_SECONDS = re.compile(rb"copied, ([0-9.eE+-]+) s")
_SPACE_MARGIN = 256 << 20


@dataclass(slots=True)
class SsdParams:
    directory: Path
    chunk_bytes: int
    total_bytes: int
    batch_chunks: int
    rounds: int

    @property
    def num_chunks(self) -> int:
        return self.total_bytes // self.chunk_bytes

    @property
    def batch(self) -> int:
        """Chunks per batch (and source/destination buffers), at most all of them."""
        return min(self.batch_chunks, self.num_chunks)


@dataclass
class SsdResults:
    params: SsdParams
    rates: dict[str, list[float]] = field(default_factory=dict)
    """``"<path> <op>"`` -> GB/s of each round."""
    device_read: dict[str, list[float]] = field(default_factory=dict)
    """``"<path>"`` -> bytes the block layer read / bytes asked for, each read round."""
    identical: bool = True
    """Every chunk the tier read back equalled what it wrote."""
    dd_version: str = ""

    def add(self, path: str, op: str, num_bytes: int, seconds: float) -> float:
        rate = gbps(num_bytes, seconds)
        self.rates.setdefault(f"{path} {op}", []).append(rate)
        return rate


def check_params(params: SsdParams) -> None:
    if params.chunk_bytes <= 0 or params.chunk_bytes % mmap.PAGESIZE:
        raise ValueError(f"ssd chunk size must be a positive multiple of {mmap.PAGESIZE} bytes")
    if params.num_chunks < 1 or params.batch_chunks < 1 or params.rounds < 1:
        raise ValueError("ssd total, batch and rounds must allow at least one chunk and round")
    if shutil.which("dd") is None:
        raise RuntimeError("dd is not on PATH: it is the SSD baseline")
    free = shutil.disk_usage(params.directory).free
    need = params.total_bytes + params.num_chunks * 2 * mmap.PAGESIZE + _SPACE_MARGIN
    if free < need:
        raise RuntimeError(
            f"{params.directory} has {free / 2**20:.0f} MiB free; the SSD case needs "
            f"{need / 2**20:.0f} MiB: pass a smaller ssd_total_mib or another ssd_dir"
        )


def measure_ssd(params: SsdParams, progress: Progress) -> SsdResults:
    """Alternating rounds of dd, single and batched tier transfers; see the module docstring."""
    check_params(params)
    results = SsdResults(params, dd_version=_dd_version())
    tier_dir = params.directory / "tier"
    try:
        tier = SsdTier(tier_dir, 2 * params.total_bytes + (1 << 30), o_direct=True)
    except ConfigError as e:
        hint = "O_DIRECT needs a disk file system, not tmpfs: --set ssd_dir=..."
        raise RuntimeError(f"{e} ({hint})") from None
    src = _aligned(params.batch * params.chunk_bytes)
    out = _aligned(params.batch * params.chunk_bytes)
    try:
        np.frombuffer(src, dtype=np.uint8)[:] = np.random.default_rng(1).integers(
            0, 256, len(src), dtype=np.uint8
        )
        bench = _TierBench(tier, params, src, out)
        runs: list[Callable[[], None]] = [
            lambda: _dd_round(params, results),
            lambda: bench.round("tier single", results, batched=False),
            lambda: bench.round("tier batched", results, batched=True),
        ]
        for r in range(params.rounds):
            for i in range(len(runs)):
                runs[(r + i) % len(runs)]()
            last = {k: f"{v[-1]:.2f}" for k, v in results.rates.items()}
            progress(f"ssd round {r + 1}/{params.rounds}: GB/s {last}")
    finally:
        tier.close()
        shutil.rmtree(tier_dir, ignore_errors=True)
    return results


class _TierBench:
    def __init__(self, tier: SsdTier, params: SsdParams, src: mmap.mmap, out: mmap.mmap) -> None:
        self.tier = tier
        self.params = params
        size = params.chunk_bytes
        self.src = [memoryview(src)[i * size : (i + 1) * size] for i in range(params.batch)]
        self.out = [memoryview(out)[i * size : (i + 1) * size] for i in range(params.batch)]
        self.keys = [ChunkKey(os.urandom(48)) for _ in range(params.num_chunks)]

    def round(self, path: str, results: SsdResults, *, batched: bool) -> None:
        """Write every chunk, read every chunk back, check the bytes, delete them."""
        total = self.params.num_chunks * self.params.chunk_bytes
        for view in self.out:
            view[:] = bytes(len(view))
        start = time.perf_counter()
        ok = self._write(batched)
        results.add(path, "write", total, time.perf_counter() - start)
        blocks = resource.getrusage(resource.RUSAGE_SELF).ru_inblock
        start = time.perf_counter()
        ok &= self._read(batched)
        results.add(path, "read", total, time.perf_counter() - start)
        blocks = resource.getrusage(resource.RUSAGE_SELF).ru_inblock - blocks
        results.device_read.setdefault(path, []).append(blocks * 512 / total)
        # each output buffer holds the last chunk read into it, written from the same index
        results.identical &= ok and all(map(_equal, self.out, self.src))
        for key in self.keys:
            self.tier.delete(key)

    def _pairs(self) -> list[list[tuple[int, ChunkKey]]]:
        n = self.params.batch
        indexed = list(enumerate(self.keys))
        return [indexed[i : i + n] for i in range(0, len(indexed), n)]

    def _write(self, batched: bool) -> bool:
        n, ok = self.params.batch, True
        for batch in self._pairs():
            if batched:
                ok &= all(self.tier.put_many([(k, self.src[i % n]) for i, k in batch]))
            else:
                for i, k in batch:
                    ok &= self.tier.put(k, self.src[i % n])
        return ok

    def _read(self, batched: bool) -> bool:
        n, ok = self.params.batch, True
        for batch in self._pairs():
            if batched:
                ok &= all(self.tier.read_many_into([(k, self.out[i % n]) for i, k in batch]))
            else:
                for i, k in batch:
                    ok &= self.tier.read_into(k, self.out[i % n])
        return ok


def _equal(a: memoryview, b: memoryview) -> bool:
    return bool(np.array_equal(np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)))


def _dd_round(params: SsdParams, results: SsdResults) -> None:
    """dd writes one file of the same bytes with O_DIRECT, reads it back, removes it."""
    target = params.directory / "dd.bin"
    target.unlink(missing_ok=True)
    common = [f"bs={params.chunk_bytes}", f"count={params.num_chunks}"]
    total = params.num_chunks * params.chunk_bytes
    results.add(
        "dd", "write", total, _dd(["if=/dev/zero", f"of={target}", *common, "oflag=direct"])
    )
    blocks = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock
    results.add("dd", "read", total, _dd([f"if={target}", "of=/dev/null", *common, "iflag=direct"]))
    blocks = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock - blocks
    results.device_read.setdefault("dd", []).append(blocks * 512 / total)
    target.unlink(missing_ok=True)


def _dd(args: list[str]) -> float:
    """Seconds dd itself reports for the transfer (its start-up is not counted)."""
    env = {**os.environ, "LC_ALL": "C"}
    done = subprocess.run(["dd", *args], capture_output=True, env=env, timeout=600, check=False)
    match = _DD_SECONDS.search(done.stderr)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"dd {' '.join(args)} failed: {done.stderr.decode(errors='replace')}")
    return float(match.group(1))


def _dd_version() -> str:
    done = subprocess.run(["dd", "--version"], capture_output=True, text=True, check=False)
    return done.stdout.splitlines()[0] if done.stdout else ""


def _aligned(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory, touched so page faults stay out of the timings."""
    buf = mmap.mmap(-1, nbytes)
    np.frombuffer(buf, dtype=np.uint8)[:] = 1
    return buf


def scratch_dir(base: Path) -> Path:
    """A fresh directory for one run inside ``base`` (which must exist)."""
    if not base.is_dir():
        raise ValueError(f"ssd_dir {str(base)!r} is not an existing directory")
    return Path(tempfile.mkdtemp(prefix="lmc-bench-ssd-", dir=base))

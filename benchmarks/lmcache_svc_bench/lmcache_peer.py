"""LMCache 0.5.6 as a side-by-side peer: its venv, its server, its own benchmark client.

Never a dependency of lmcache-svc: ``scripts/setup_lmcache.sh`` builds ``.venv-lmcache``
(once; a stamp file makes later runs return at once) and everything here runs LMCache as
separate processes: ``lmcache server`` (CPU, shared-memory L1 pool) and ``lmcache bench
server`` in engine-driven mode (the worker gathers KV pages into shared-memory slots between
PREPARE and COMMIT, the analogue of our prepare_store/commit_store).

What its client measures (read from ``lmcache bench server --help`` and its source): each
sequence is one request of ``--num-tokens`` tokens, of which the full 256-token chunks are
used; a cold pass does LOOKUP (+ polling the prefetch status) then one STORE of all those
chunks, a warm pass does LOOKUP then one RETRIEVE; each call is timed on its own and the
JSON holds count/mean/min/max/p50/p99 in milliseconds per kind of call.

Memory state: LMCache creates its pool with ``ftruncate`` and never touches it, so its first
stores would pay this VM's slow first-touch page faults. Like our server's ``--prefault
sync``, every page of the pool is allocated and faulted in before the run
(``posix_fallocate`` + ``MADV_POPULATE_WRITE``; the pages stay zero and unused). Its client
maps the pool without pre-faulting (its design; ours pre-faults its mapping).
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache_svc_bench.held_signals import start_process
from lmcache_svc_bench.procs import free_port

LMCACHE_VERSION = "0.5.6"
SHAPE_SPEC = "(2,512,16,2,128):float16:32"
TOKEN_BYTES = 32 << 10  # 2 (K, V) * 2 heads * 128 * fp16 * 32 layers
CHUNK_TOKENS = 256
CHUNK_BYTES = TOKEN_BYTES * CHUNK_TOKENS  # 8 MiB
MADV_POPULATE_WRITE: int = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_ENV = {
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "LMCACHE_DISABLE_BANNER": "1",
    "PYTHONWARNINGS": "ignore",
}


class PeerUnavailable(Exception):
    """LMCache could not be set up or run here; the message says why."""


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def ensure_venv(progress: Callable[[str], None], venv: Path | None = None) -> Path:
    """``.venv-lmcache`` (built by scripts/setup_lmcache.sh on first use), or PeerUnavailable."""
    root = repo_root()
    venv = venv or root / ".venv-lmcache"
    script = root / "scripts" / "setup_lmcache.sh"
    if not script.exists():
        if (venv / "bin" / "lmcache").exists():
            return venv
        raise PeerUnavailable(f"{script} not found (not a source checkout) and no {venv}")
    progress(
        f"LMCache {LMCACHE_VERSION} venv: {venv} (scripts/setup_lmcache.sh; first time ~2 min)"
    )
    proc = start_process(
        ["bash", str(script)],
        env={**os.environ, "VENV": str(venv)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-20:]
        if line.startswith("[setup_lmcache"):
            progress(line)
    if proc.wait() != 0:
        raise PeerUnavailable(
            f"scripts/setup_lmcache.sh failed (exit {proc.returncode}; no network to PyPI?): "
            + " | ".join(tail[-4:])
        )
    return venv


@dataclass(frozen=True, slots=True)
class PeerRun:
    """One ``lmcache bench server`` run: per-call latencies in ms (p50/mean) and checks."""

    num_calls: int
    call_bytes: int
    store_ms_p50: float
    store_ms_mean: float
    retrieve_ms_p50: float
    retrieve_ms_mean: float
    lookup_ms_p50: float
    lookup_ms_p99: float
    checksum_ok: int
    raw: dict[str, Any]

    @classmethod
    def from_json(cls, data: dict[str, Any], call_bytes: int) -> PeerRun:
        m = data["metrics"]
        try:
            return cls(
                num_calls=int(m["cold_store"]["cold_store_count"]),
                call_bytes=call_bytes,
                store_ms_p50=float(m["cold_store"]["cold_store_p50"]),
                store_ms_mean=float(m["cold_store"]["cold_store_mean"]),
                retrieve_ms_p50=float(m["warm_retrieve"]["warm_retrieve_p50"]),
                retrieve_ms_mean=float(m["warm_retrieve"]["warm_retrieve_mean"]),
                lookup_ms_p50=float(m["warm_lookup"]["warm_lookup_p50"]),
                lookup_ms_p99=float(m["warm_lookup"]["warm_lookup_p99"]),
                checksum_ok=int(m["results"]["checksum_ok"]),
                raw=m,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PeerUnavailable(f"unexpected `lmcache bench server` JSON ({e!r})") from None


class LMCacheServer:
    """``lmcache server`` on free loopback ports with a pre-allocated shared-memory pool."""

    def __init__(self, venv: Path, work_dir: Path, l1_gb: float, *, threads: int = 1) -> None:
        self.venv = venv
        self.env = {**os.environ, **_ENV, "OMP_NUM_THREADS": str(threads)}
        self.port, self.http_port = free_port(), free_port()
        self.shm_name = f"lmcsvcbench{os.getpid()}x{time.monotonic_ns() % 10**6}"
        self.log_path = work_dir / "lmcache-server.log"
        cmd = [
            str(venv / "bin" / "lmcache"), "server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
            "--l1-size-gb", f"{l1_gb:g}", "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto", "--shm-name", self.shm_name,
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = start_process(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

    @property
    def pool_path(self) -> Path:
        return Path("/dev/shm", f"lmcache_l1_pool_{self.shm_name}")

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerUnavailable(f"lmcache server exited: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.http_url + "/", timeout=1) as resp:
                    if resp.status == 200 and self.pool_path.exists():
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise PeerUnavailable(f"lmcache server not ready in {timeout_s:.0f} s: {self.log_tail()}")

    def prefault_pool(self) -> float:
        """Allocate and write-fault every page of the pool, as our ``--prefault sync`` does
        (``posix_fallocate`` alone leaves tmpfs pages to be zeroed on first touch); the
        pages stay zero. Returns the seconds taken."""
        start = time.perf_counter()
        fd = os.open(self.pool_path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            os.posix_fallocate(fd, 0, size)
            with mmap.mmap(fd, size) as mm:
                for offset in range(0, size, 64 << 20):
                    length = min(64 << 20, size - offset)
                    try:
                        mm.madvise(MADV_POPULATE_WRITE, offset, length)
                    except OSError:  # kernel before 5.14: read a byte per page
                        mm[offset : offset + length : mmap.PAGESIZE]
        finally:
            os.close(fd)
        return time.perf_counter() - start

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM its process group, SIGKILL after 20 s; remove the pool if it stayed."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.pool_path.unlink(missing_ok=True)


def run_client(
    server: LMCacheServer, work_dir: Path, *, num_tokens: int, first_seq: int, num_calls: int
) -> PeerRun:
    """LMCache's own client, engine-driven, on the 32 KiB/token shape; parsed JSON."""
    out = work_dir / f"lmcache-bench-{first_seq}.json"
    cmd = [
        str(server.venv / "bin" / "lmcache"), "bench", "server",
        "--rpc-url", f"tcp://127.0.0.1:{server.port}", "--url", server.http_url,
        "--mode", "cpu", "--transfer-mode", "engine_driven",
        "--kvcache-shape-spec", SHAPE_SPEC, "--num-tokens", str(num_tokens),
        "--start", str(first_seq), "--end", str(first_seq + num_calls),
        "--interval", "0", "--format", "json", "--output", str(out), "--quiet",
    ]  # fmt: skip
    done = subprocess.run(cmd, env=server.env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0 or not out.exists():
        tail = (done.stdout + done.stderr)[-1500:]
        raise PeerUnavailable(f"lmcache bench server failed (exit {done.returncode}): {tail}")
    return PeerRun.from_json(json.loads(out.read_text()), call_bytes(num_tokens))


def call_bytes(num_tokens: int) -> int:
    """Bytes per STORE/RETRIEVE call: the full chunks of a ``num_tokens`` request."""
    return (num_tokens // CHUNK_TOKENS) * CHUNK_BYTES


def pool_gb(total_bytes: int) -> float:
    """An L1 size in GB (LMCache's unit: GiB) that holds ``total_bytes`` with room to spare."""
    return max(1.0, round(total_bytes * 1.25 / 2**30 + 0.25, 1))

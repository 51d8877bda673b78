"""The processes a soak run drives, and the faults it injects into them.

``SoakStack`` owns a server (fixed socket and ports, so clients find it again after a
restart, with an SSD tier and a Redis tier) and the redis-server it starts itself; it can
crash, stop and restart either one. ``Victims`` runs store-only clients and SIGKILLs them at
random moments, so most kills land in the middle of a store. Everything is on loopback.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from lmcache_svc_bench.held_signals import start_process
from lmcache_svc_bench.procs import ServerProc, free_port, start_server
from lmcache_svc_bench.redis_procs import RedisProc, redis_server_path, start_redis

SERVER_ENV = {
    "LMCACHE_SVC_REDIS__TIMEOUT_S": "1.0",
    "LMCACHE_SVC_REDIS__BREAKER_MAX_BACKOFF_S": "2",
    "LMCACHE_SVC_CACHE__RESERVATION_TTL_S": "10",
}


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class SoakStack:
    def __init__(self, work: Path, *, arena: str = "64MiB", with_redis: bool = True) -> None:
        self.work = work
        self.socket = str(work / "grpc.sock")
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.arena = arena
        self.redis: RedisProc | None = None
        if with_redis and redis_server_path() is not None:
            self.redis = start_redis(work / "redis")
        self.server = self._start_server()
        self.events: list[tuple[float, str]] = []

    @property
    def tcp_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def memory_dir(self) -> Path:
        """Where the server keeps named memories (under the SSD tier's path)."""
        return self.work / "ssd" / "memories"

    def _start_server(self) -> ServerProc:
        args = [
            "--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port),
            "--cpu-bytes", self.arena, "--ssd-path", str(self.work / "ssd"),
            "--ssd-bytes", "512MiB", "--log-level", "warning",
        ]  # fmt: skip
        if self.redis is not None:
            args += ["--redis-url", self.redis.url, "--redis-bytes", "512MiB"]
        return start_server(self.work, *args, env=SERVER_ENV, socket_path=self.socket)

    def _event(self, what: str) -> None:
        self.events.append((time.time(), what))

    # -- server ----------------------------------------------------------------------------

    def crash_server(self) -> None:
        self._event("server SIGKILL")
        self.server.kill()

    def stop_server(self) -> None:
        self._event("server SIGTERM")
        self.server.stop()

    def restart_server(self) -> None:
        self.server = self._start_server()
        self._event("server started")

    # -- redis -----------------------------------------------------------------------------

    def hang_redis(self) -> None:
        if self.redis is not None:
            self._event("redis SIGSTOP")
            os.kill(self.redis.process.pid, signal.SIGSTOP)

    def resume_redis(self) -> None:
        if self.redis is not None:
            os.kill(self.redis.process.pid, signal.SIGCONT)
            self._event("redis SIGCONT")

    def kill_redis(self) -> None:
        if self.redis is not None:
            self._event("redis SIGKILL")
            self.redis.stop()

    def restart_redis(self) -> None:
        if self.redis is not None:
            self.redis = start_redis(self.work / "redis", port=self.redis.port)
            self._event("redis started (empty)")

    def rss(self) -> tuple[int, int]:
        server = rss_bytes(self.server.proc.pid) if self.server.proc.poll() is None else 0
        redis = rss_bytes(self.redis.process.pid) if self.redis is not None else 0
        return server, redis

    def close(self) -> None:
        if self.redis is not None:
            try:
                os.kill(self.redis.process.pid, signal.SIGCONT)
            except OSError:
                pass
            self.redis.stop()
        try:
            self.server.stop()
        finally:
            self.server.cleanup()


def spawn_worker(
    address: str, out: Path, until: float, *, inline: bool = False, store_only: bool = False,
    key_space: int = 600, max_ops: int = 1_000_000, memories: str | None = None,
    http_url: str = "", stop_file: Path | None = None,
) -> subprocess.Popen[bytes]:  # fmt: skip
    cmd = [
        sys.executable, "-m", "lmcache_svc_bench.soak_worker", "--address", address,
        "--out", str(out), "--until", str(until), "--key-space", str(key_space),
        "--max-ops", str(max_ops), "--stop-file", str(stop_file or ""),
    ]  # fmt: skip
    if inline:
        cmd.append("--inline")
    if store_only:
        cmd.append("--store-only")
    if memories is not None:
        cmd += ["--memories", memories, "--http-url", http_url]
    log = open(out.with_suffix(".log"), "wb")  # noqa: SIM115 - the child owns it
    return start_process(cmd, stdout=log, stderr=subprocess.STDOUT)


class Victims:
    """Store-only clients killed (SIGKILL) at random moments and replaced."""

    def __init__(
        self, stack: SoakStack, out_dir: Path, until: float, key_space: int,
        stop_file: Path | None = None,
    ) -> None:  # fmt: skip
        self.stack = stack
        self.out_dir = out_dir
        self.until = until
        self.stop_file = stop_file
        self.key_space = key_space
        self.kills = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._rng = random.Random(0)

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self._proc is None or self._proc.poll() is not None:
                out = self.out_dir / f"victim-{self.kills}.json"
                self._proc = spawn_worker(
                    self.stack.socket, out, self.until, store_only=True,
                    key_space=self.key_space, stop_file=self.stop_file,
                )  # fmt: skip
            time.sleep(min(self._rng.uniform(1.5, 3.0), max(0.0, end - time.monotonic())))
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
                self.kills += 1
                self.stack._event("client SIGKILL")

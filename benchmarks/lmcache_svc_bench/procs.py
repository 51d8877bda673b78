"""Start and stop real ``lmcache-svc serve`` processes for tests and benchmarks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcache_svc_bench.held_signals import start_process


def free_port() -> int:
    """A loopback port that was free a moment ago (bound to port 0, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProc:
    proc: subprocess.Popen[bytes]
    workdir: Path
    log_path: Path
    ready: dict[str, Any] = field(default_factory=dict)

    @property
    def socket(self) -> str:
        return str(self.ready["socket"])

    @property
    def grpc(self) -> str:
        return str(self.ready["grpc"])

    @property
    def http_url(self) -> str:
        return str(self.ready["http"])

    @property
    def shm(self) -> str:
        return str(self.ready["shm"])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server did not stop on SIGTERM within {timeout_s} s") from None

    def kill(self) -> None:
        """SIGKILL: no clean-up at all (the segment stays in /dev/shm)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if "shm" in self.ready:
            Path("/dev/shm", self.shm).unlink(missing_ok=True)

    def cpu_s(self) -> float:
        """CPU seconds the server's live threads have run so far (Linux schedstat, ns)."""
        total = 0
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):  # a thread that just ended
                continue
        return total / 1e9

    def wait_idle(
        self, window_s: float = 0.1, busy_s: float = 0.005, timeout_s: float = 10.0
    ) -> bool:
        """Wait until the server used at most ``busy_s`` of CPU in ``window_s`` (its
        background work after the last requests done); False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        used = self.cpu_s()
        while time.monotonic() < deadline:
            time.sleep(window_s)
            used, before = self.cpu_s(), used
            if used - before <= busy_s:
                return True
        return False

    def cleanup(self) -> None:
        """Kill the server if it runs and remove what a killed server leaves behind."""
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_server(
    tmp_path: Path | None = None,
    *args: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 30.0,
    socket_path: str | None = None,
) -> ServerProc:
    """Run ``python -m lmcache_svc serve`` on free ports; returns once it is serving.

    Defaults: a 256 MiB arena, a Unix socket in a short private directory (socket paths are
    limited to 108 bytes), gRPC and HTTP on free loopback ports. ``args`` are extra flags
    and override those defaults.
    """
    workdir = Path(tempfile.mkdtemp(prefix="lmc-", dir="/tmp"))
    ready_file = workdir / "ready.json"
    log_path = (tmp_path or workdir) / f"server-{time.monotonic_ns()}.log"
    cmd = [
        sys.executable,
        "-m",
        "lmcache_svc",
        "serve",
        "--socket",
        socket_path or str(workdir / "grpc.sock"),
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        "--cpu-bytes",
        "256MiB",
        "--log-level",
        "info",
        "--ready-file",
        str(ready_file),
        *args,
    ]
    run_env = {**os.environ, **(env or {})}
    run_env.setdefault("PYTHONUNBUFFERED", "1")
    server: ServerProc | None = None
    try:
        with open(log_path, "wb") as log:  # a Ctrl-C or SIGTERM meanwhile: killed, raised
            proc = start_process(cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env)
        server = ServerProc(proc, workdir, log_path)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready_file.exists():
                server.ready = json.loads(ready_file.read_text())
                return server
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    except BaseException:  # Ctrl-C while waiting must not leave a server running
        if server is not None:
            server.cleanup()
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    server.cleanup()
    raise RuntimeError(f"server did not become ready (exit {proc.poll()}):\n{server.log()[-4000:]}")

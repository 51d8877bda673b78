"""Start and stop throwaway ``redis-server`` processes for tests and benchmarks.

Each server listens on 127.0.0.1 only, on a free port, persists nothing and keeps its files
in a directory the caller owns. Every wait is bounded; a failed start kills what it started.
"""

from __future__ import annotations

import atexit
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lmcache_svc_bench.held_signals import start_process
from lmcache_svc_bench.procs import free_port

REDIS_SERVER = "redis-server"
REDIS_CLI = "redis-cli"
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
CLUSTER_BUS_OFFSET = 10000
MAX_CLUSTER_PORT = 65535 - CLUSTER_BUS_OFFSET


def redis_server_path() -> str | None:
    """Absolute path of ``redis-server`` on PATH, or ``None``."""
    return shutil.which(REDIS_SERVER)


def free_cluster_port() -> int:
    """A free port ``P <= 55535`` whose cluster bus port ``P + 10000`` is free too."""
    for _ in range(200):
        port = free_port()
        if port <= MAX_CLUSTER_PORT and _can_bind(port + CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("found no free port pair for a Redis Cluster node")


def _can_bind(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def send_command(port: int, *args: str, timeout_s: float = 1.0) -> bytes:
    """Send one command in RESP and return the raw reply (enough for PING and CLUSTER INFO)."""
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(b"".join(parts))
        return _read_reply(sock)


def _read_reply(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    if data.startswith(b"$"):  # bulk string: read until the announced length is there
        length = int(data[1 : data.index(b"\r\n")])
        total = data.index(b"\r\n") + 2 + max(length, 0) + 2
        while len(data) < total:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return data


@dataclass(slots=True)
class RedisProc:
    """One running ``redis-server``; ``stop()`` kills it and waits for it."""

    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"redis-server on port {self.port} did not exit") from e

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""


@dataclass(slots=True)
class RedisClusterProcs:
    """The nodes of one running Redis Cluster (masters only)."""

    nodes: list[RedisProc] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _spawn(tmpdir: Path, port: int, extra_args: Sequence[str]) -> RedisProc:
    binary = redis_server_path()
    if binary is None:
        raise RuntimeError("redis-server is not on PATH")
    workdir = tmpdir / f"redis-{port}"
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "redis.log"
    args = [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no", "--dir", str(workdir), "--protected-mode", "yes",
        "--logfile", str(log_path), *extra_args,
    ]  # fmt: skip
    process = start_process(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    atexit.register(_kill_quietly, process)  # a safety net if the caller never stops it
    return RedisProc(port, process, log_path)


def _kill_quietly(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=STOP_TIMEOUT_S)


def _wait_for_ping(proc: RedisProc, deadline: float) -> None:
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"redis-server on port {proc.port} exited: {proc.log_tail()}")
        try:
            if send_command(proc.port, "PING").startswith(b"+PONG"):
                return
        except OSError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"redis-server on port {proc.port} did not answer PING in time")


def start_redis(
    tmpdir: str | Path,
    *,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float = START_TIMEOUT_S,
) -> RedisProc:
    """Start one ``redis-server`` (on ``port``, or a free one) and wait until it answers PING.

    With no ``port`` given, a start that fails (e.g. the free port was taken meanwhile) is
    retried on another port, up to three times.
    """
    attempts = 1 if port is not None else 3
    for attempt in range(attempts):
        proc = _spawn(Path(tmpdir), port if port is not None else free_port(), extra_args)
        try:
            _wait_for_ping(proc, time.monotonic() + timeout_s)
            return proc
        except BaseException:
            proc.stop()
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def start_redis_cluster(
    tmpdir: str | Path, n: int = 3, *, timeout_s: float = 2 * START_TIMEOUT_S
) -> RedisClusterProcs:
    """Start ``n`` (>= 3) cluster-enabled masters, join them, wait for ``cluster_state:ok``."""
    if n < 3:
        raise ValueError(f"a Redis Cluster needs at least 3 masters, got n={n}")
    cluster = RedisClusterProcs()
    try:
        for _ in range(n):
            cluster.nodes.append(_start_cluster_node(Path(tmpdir)))
        deadline = time.monotonic() + timeout_s
        _create_cluster(cluster, deadline)
        _wait_cluster_ok(cluster, deadline)
        return cluster
    except BaseException:
        cluster.stop()
        raise


def _start_cluster_node(tmpdir: Path) -> RedisProc:
    for attempt in range(3):  # the port pair may be taken between the check and the start
        port = free_cluster_port()
        extra = ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                 "--cluster-node-timeout", "5000"]  # fmt: skip
        try:
            return start_redis(tmpdir, port=port, extra_args=extra)
        except RuntimeError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _create_cluster(cluster: RedisClusterProcs, deadline: float) -> None:
    cli = shutil.which(REDIS_CLI)
    if cli is None:
        raise RuntimeError("redis-cli is not on PATH")
    addrs = [f"127.0.0.1:{node.port}" for node in cluster.nodes]
    args = [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"]
    timeout = max(deadline - time.monotonic(), 1.0)
    done = subprocess.run(
        args, check=False, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if done.returncode != 0:
        out = (done.stdout + done.stderr).decode(errors="replace")[-2000:]
        raise RuntimeError(f"redis-cli --cluster create failed: {out}")


def _wait_cluster_ok(cluster: RedisClusterProcs, deadline: float) -> None:
    pending = list(cluster.nodes)
    while pending and time.monotonic() < deadline:
        pending = [node for node in pending if not _cluster_ok(node)]
        if pending:
            time.sleep(0.05)
    if pending:
        ports = [node.port for node in pending]
        raise RuntimeError(f"Redis Cluster nodes {ports} did not reach cluster_state:ok")


def _cluster_ok(node: RedisProc) -> bool:
    try:
        return b"cluster_state:ok" in send_command(node.port, "CLUSTER", "INFO")
    except OSError:
        return False

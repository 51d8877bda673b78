"""The server process: builds the tiers from the config, serves gRPC and REST in one event
loop, and shuts down cleanly on SIGTERM/SIGINT (stops accepting, finishes queued
write-throughs, removes the shared-memory segment and the Unix socket)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import uvicorn

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.cache.values import TierPolicy
from lmcache_svc.config import Config
from lmcache_svc.errors import ConfigError
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.events.wiring import close_events, events_addresses, node_events
from lmcache_svc.server.grpc.cache_service import build_grpc_server, set_serving
from lmcache_svc.server.grpc.memory_service import add_memory_service
from lmcache_svc.server.http.api import create_app
from lmcache_svc.server.http.server import ConnectionLimits, make_uvicorn_config
from lmcache_svc.server.index_publisher import lookup_index
from lmcache_svc.server.memories.store import MemoryStore
from lmcache_svc.server.tokens import Authenticator, make_authenticator
from lmcache_svc.shm.arena import Arena, remove_orphan_segments
from lmcache_svc.tiers.base import Tier
from lmcache_svc.tiers.cpu import CpuTier

log = logging.getLogger("lmcache_svc")


def build_cache(config: Config) -> TieredCache:
    """The tiers in order (CPU arena, then HBM, SSD and Redis when configured) and the
    policy."""
    c = config.cpu
    arena = Arena.create(
        int(c.capacity),
        slab_bytes=c.slab_bytes(),
        name=c.shm_name,
        mode=c.shm_mode,
        prefault=c.prefault,
    )
    lower: list[tuple[Tier, TierPolicy]] = []
    try:
        h = config.hbm
        if h.capacity is not None:
            from lmcache_svc.tiers.hbm import DevicePool, HbmTier

            pool = DevicePool.allocate(int(h.capacity), h.device)  # ConfigError without CUDA
            hbm = HbmTier(pool, slab_bytes=h.slab_bytes())
            lower.append((hbm, TierPolicy.from_config(h)))
        s = config.ssd
        if s.path is not None:
            from lmcache_svc.tiers.ssd import SsdTier

            ssd = SsdTier(s.path, int(s.capacity), fsync=s.fsync, o_direct=s.o_direct)
            lower.append((ssd, TierPolicy.from_config(s)))
        r = config.redis
        if r.url is not None:
            from lmcache_svc.tiers.redis import RedisTier

            redis = RedisTier(
                r.url,
                int(r.capacity),
                cluster=r.cluster,
                ttl_s=r.ttl_s,
                num_connections=r.connections,
                key_prefix=r.key_prefix,
                timeout_s=r.timeout_s,
            )
            lower.append((redis, TierPolicy.from_config(r)))
    except BaseException:
        arena.close()
        for made, _ in lower:
            made.close()
        raise
    settings = CacheSettings.from_config(config)
    first = CpuTier(arena)
    index = lookup_index(config, first.name, first.medium)
    metrics = Metrics()
    try:
        events = node_events(config, metrics, [t for t, _ in lower])
    except BaseException:
        arena.close()
        for made, _ in lower:
            made.close()
        raise
    return TieredCache(
        first, lower, settings=settings, metrics=metrics, lookup_index=index, listener=events
    )


def build_memory_store(config: Config) -> MemoryStore:
    """The named memories: on disk under the resolved memory path, else in RAM."""
    m = config.memory
    return MemoryStore(
        capacity_bytes=int(m.capacity),
        max_bytes=int(m.max_bytes),
        path=m.resolved_path(config.ssd.path),
        max_transfers=m.max_transfers,
    )


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the service owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto
    # says TCP; without it a response sent in two writes waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} for HTTP: {e.strerror}") from None
    sock.listen(512)
    sock.set_inheritable(True)
    return sock


def _prepare_socket_path(path: Path, mode: int) -> None:
    """Create the socket's directory and remove a stale socket file; refuse a live one."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700 if mode & 0o077 == 0 else 0o711)
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # nobody listens: a leftover of a killed server
        return
    finally:
        probe.close()
    raise ConfigError(f"another server is already listening on {path}")


class Service:
    def __init__(self, config: Config) -> None:
        self.config = config
        self._stop = asyncio.Event()
        self.auth: Authenticator | None = make_authenticator(config.auth_token, config.tokens_file)

    def request_stop(self) -> None:
        self._stop.set()

    def reload_tokens(self) -> None:
        """SIGHUP: re-read the tokens file soon, on a thread of its own (never on the event
        loop; a burst of signals makes at most one reload after the one running; a bad file
        is logged and the old tokens stay)."""
        if self.auth is not None:
            self.auth.request_reload()

    async def run(self) -> None:
        cfg = self.config
        callers = asyncio.all_tasks()  # this one and those waiting on it: not the server's
        if cfg.socket is not None:
            _prepare_socket_path(cfg.socket, cfg.socket_mode)
        for name in remove_orphan_segments():
            log.warning("removed shared-memory segment %s: its server was killed", name)
        memories = build_memory_store(cfg)
        cache = build_cache(cfg)
        try:  # until the try below owns it: a failure here must not leave the arena behind
            cache.start()
            cache.metrics.watch_memories(memories.usage)
            grpc_server, servicer, health = build_grpc_server(
                cache,
                max_body_bytes=int(cfg.max_body_bytes),
                workers=cfg.grpc_workers,
                auth=self.auth,
            )
            add_memory_service(grpc_server, memories, cache.metrics, self.auth)
        except BaseException:
            cache.close()
            close_events(cache)
            raise
        addresses: dict[str, Any] = {"shm": cache.segment().name, "pid": os.getpid()}
        addresses.update(events_addresses(cache))
        http: _Uvicorn | None = None
        http_task: asyncio.Task[None] | None = None
        try:
            if cfg.socket is not None:
                grpc_server.add_insecure_port(f"unix:{cfg.socket}")
                addresses["socket"] = str(cfg.socket)
            if cfg.grpc_port is not None:
                port = _add_grpc_port(grpc_server, cfg.host, cfg.grpc_port)
                addresses["grpc"] = _host_port(cfg.host, port)
            await grpc_server.start()
            if cfg.socket is not None:
                os.chmod(cfg.socket, cfg.socket_mode)
            await set_serving(health, True)
            if cfg.http_port is not None:
                sock = _bind_tcp(cfg.host, cfg.http_port)
                addresses["http"] = f"http://{_host_port(cfg.host, sock.getsockname()[1])}"
                h = cfg.http
                app = create_app(
                    cache,
                    auth=self.auth,
                    max_body_bytes=int(cfg.max_body_bytes),
                    max_json_bytes=int(h.max_json_bytes),
                    body_idle_timeout_s=h.body_idle_timeout_s,
                    memories=memories,
                )
                limits = ConnectionLimits(h.header_timeout_s, h.keep_alive_s, h.max_connections)
                http = _Uvicorn(make_uvicorn_config(app, limits, lifespan="off"))
                http_task = asyncio.create_task(http.serve(sockets=[sock]))
            self._announce(addresses)
            await self._stop.wait()
            log.info("stopping: draining requests and write-throughs")
        finally:
            await set_serving(health, False)
            if http is not None and http_task is not None:
                http.should_exit = True
                await http_task
            servicer.stop()
            await grpc_server.stop(grace=5)
            await _calls_end(callers, timeout_s=5)
            servicer.close()
            cache.close()
            close_events(cache)
            if cfg.socket is not None:
                with contextlib.suppress(FileNotFoundError):
                    cfg.socket.unlink()
            log.info("stopped")

    def _announce(self, addresses: dict[str, Any]) -> None:
        line = json.dumps({"event": "ready", **addresses})
        log.info("serving: %s", line)
        print(line, flush=True)
        if self.config.ready_file is not None:
            tmp = self.config.ready_file.with_suffix(".tmp")
            tmp.write_text(line + "\n")
            tmp.replace(self.config.ready_file)


async def _calls_end(callers: set[asyncio.Task[Any]], timeout_s: float) -> None:
    """After the gRPC server stopped: let what its calls left on the loop end before the cache
    closes and the loop cancels it. A session's clean-up (its client went away) still runs on
    the arena pool, and a call's last step (its final status) can wake in the same turn as
    the server's shutdown."""
    left = asyncio.all_tasks() - callers
    if not left:
        return
    _, pending = await asyncio.wait(left, timeout=timeout_s)
    if pending:
        log.warning("%d tasks of gRPC calls still running %g s after the server stopped: "
                    "closing the cache under them", len(pending), timeout_s)  # fmt: skip


def _add_grpc_port(server: grpc.aio.Server, host: str, port: int) -> int:
    """Listen on ``host:port`` (0: any free port); the port bound."""
    try:
        bound = server.add_insecure_port(_host_port(host, port))
    except RuntimeError:  # grpcio raises when the bind fails (in use, not an address here)
        bound = 0
    if bound == 0:
        raise ConfigError(f"cannot listen on {host}:{port} for gRPC (in use or not available)")
    return bound


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def serve(config: Config) -> None:
    """Run the service until SIGTERM or SIGINT."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    async def main() -> None:
        service = Service(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.request_stop)
        loop.add_signal_handler(signal.SIGHUP, service.reload_tokens)
        await service.run()

    asyncio.run(main())

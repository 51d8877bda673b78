"""A ``TieredCache`` (and optionally a ``MemoryStore``) behind a real gRPC server in this
process (a test can drive its clock and look inside the cache), and the ``serve`` fixture
that makes them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.listener import ChunkListener
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.keys import KVLayout, Namespace
from lmcache_svc.server.grpc.cache_service import build_grpc_server
from lmcache_svc.server.grpc.memory_service import add_memory_service
from lmcache_svc.server.memories.store import MemoryStore
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.cpu import CpuTier

LAYOUT = KVLayout(
    "uint8", num_layers=1, num_kv_heads=1, head_size=128, block_size=16, page_layout="test"
)
NS = Namespace(model="m", layout=LAYOUT, chunk_size=256)  # 64 KiB chunks
CHUNK = NS.chunk_bytes
NS_ID = NS.namespace_id


class InProcessServer:
    """A TieredCache behind a real gRPC server on a Unix socket, its loop in a thread."""

    def __init__(
        self,
        tmp_path: Path,
        num_chunks: int,
        settings: CacheSettings,
        memories: MemoryStore | None = None,
        listener: ChunkListener | None = None,
    ) -> None:
        arena = Arena.create(num_chunks * CHUNK, slab_bytes=CHUNK, prefault="off")
        self.cache = TieredCache(CpuTier(arena), settings=settings, listener=listener)
        self.cache.register_namespace(NS)
        self.cache.start()
        self.memories = memories
        self.socket = str(tmp_path / "grpc.sock")
        self._loop = asyncio.new_event_loop()
        self._stopped = threading.Event()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        assert started.wait(30), "the in-process gRPC server did not start"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve(started))

    async def _serve(self, started: threading.Event) -> None:
        server, servicer, _ = build_grpc_server(
            self.cache, max_body_bytes=64 << 20, workers=4, auth_token=None
        )
        if self.memories is not None:
            add_memory_service(server, self.memories, self.cache.metrics, None)
        server.add_insecure_port(f"unix:{self.socket}")
        await server.start()
        started.set()
        while not self._stopped.is_set():
            await asyncio.sleep(0.05)
        servicer.stop()
        await server.stop(grace=None)

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(30)
        self.cache.close()


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., InProcessServer]]:
    made: list[InProcessServer] = []

    def make(
        num_chunks: int = 1,
        memories: MemoryStore | None = None,
        listener: ChunkListener | None = None,
        **settings: Any,
    ) -> InProcessServer:
        settings.setdefault("high_watermark", 1.0)  # no background eviction of tiny arenas
        # and one tenant may reserve all of one (its share is tested in tests/cache/test_quotas.py)
        settings.setdefault("max_tenant_reserved_fraction", 1.0)
        srv = InProcessServer(tmp_path, num_chunks, CacheSettings(**settings), memories, listener)
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.close()

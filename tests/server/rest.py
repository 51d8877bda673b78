"""The REST app for tests: what the ``serve_http`` and ``serve_memories`` fixtures (in
``conftest.py``) return, and the small cache they serve unless given one."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.keys import Namespace
from lmcache_svc.server.memories.store import MemoryStore
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.cpu import CpuTier

MAX_BODY_BYTES = 64 * 1024  # the chunk-body limit serve_http gives the app unless told
MAX_CHUNKS = 8  # chunks per request in make_cache()


def make_cache(capacity_bytes: int = 1 << 20) -> TieredCache:
    arena = Arena.create(capacity_bytes, slab_bytes=16 * 1024, prefault="off")
    return TieredCache(CpuTier(arena), settings=CacheSettings(max_chunks_per_request=MAX_CHUNKS))


@dataclass
class Served:
    cache: TieredCache
    url: str
    client: httpx.Client

    def register(self, ns: Namespace) -> str:
        r = self.client.post("/v1/namespaces", json=ns.to_dict())
        assert r.status_code == 200, r.text
        return str(r.json()["namespace_id"])

    def chunk_url(self, ns_hex: str, chunk_hash: bytes | str) -> str:
        h = chunk_hash if isinstance(chunk_hash, str) else chunk_hash.hex()
        return f"/v1/chunks/{ns_hex}/{h}"


@dataclass
class App:
    """The app served with a memory store."""

    store: MemoryStore
    client: httpx.Client

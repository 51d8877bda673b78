"""Where memories live: the four calls ``KVCacheMemory`` makes, and two implementations.

``ServiceBackend`` talks to a running lmcache-svc server through ``CacheClient``'s memory
methods (REST/gRPC ``/v1/memories``), so every process and engine that reaches the server
sees the same memories. ``InProcessBackend`` keeps blobs in a dict with the server's
semantics (same bytes again: no-op; other bytes under a stored id: conflict), for unit tests
and single-process use.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

from lmcache_svc.errors import ConfigError, LMCacheSvcError
from lmcache_svc.memory.blob import blob_header


class MemoryInfoLike(Protocol):
    memory_id: str
    size_bytes: int
    model: str


class MemoryBackend(Protocol):
    def put_memory(self, blob: bytes) -> Any: ...

    def get_memory(self, memory_id: str) -> bytes | None: ...

    def list_memories(self) -> list[Any]: ...

    def delete_memory(self, memory_id: str) -> bool: ...


class MemoryConflict(LMCacheSvcError):
    """A memory id that already holds other bytes."""

    kind = "conflict"


def is_conflict(exc: BaseException) -> bool:
    """True for the server's (or the in-process backend's) conflict error."""
    return isinstance(exc, LMCacheSvcError) and exc.kind == "conflict"


@dataclass(frozen=True, slots=True)
class StoredMemory:
    memory_id: str
    size_bytes: int
    model: str
    metadata: dict[str, Any] = field(default_factory=dict)


class InProcessBackend:
    def __init__(self) -> None:
        self._blobs: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put_memory(self, blob: bytes) -> StoredMemory:
        meta = blob_header(blob)
        memory_id = meta["memory_id"]
        with self._lock:
            old = self._blobs.get(memory_id)
            if old is not None and old != blob:
                raise MemoryConflict(f"memory {memory_id} already holds other bytes")
            self._blobs[memory_id] = bytes(blob)
        return _info(memory_id, blob)

    def get_memory(self, memory_id: str) -> bytes | None:
        with self._lock:
            return self._blobs.get(memory_id)

    def list_memories(self) -> list[StoredMemory]:
        with self._lock:
            items = sorted(self._blobs.items())
        return [_info(memory_id, blob) for memory_id, blob in items]

    def delete_memory(self, memory_id: str) -> bool:
        with self._lock:
            return self._blobs.pop(memory_id, None) is not None


def _info(memory_id: str, blob: bytes) -> StoredMemory:
    import json

    meta = blob_header(blob)
    return StoredMemory(memory_id, len(blob), meta["model"], json.loads(meta["metadata"]))


def service_backend(address: str, auth_token: str | None, tenant: str | None) -> Any:
    """A ``CacheClient`` (it has the four memory methods) for the server at ``address``."""
    from lmcache_svc.client import CacheClient

    kwargs: dict[str, Any] = {"auth_token": auth_token, "client_name": "kv-cache-memory"}
    if tenant is not None:
        if "tenant" not in inspect.signature(CacheClient.__init__).parameters:
            raise ConfigError(
                "service.tenant is set but this client cannot name a tenant: the server "
                "picks the tenant from the auth token"
            )
        kwargs["tenant"] = tenant
    client = CacheClient(address, **kwargs)
    if not hasattr(client, "put_memory"):
        client.close()
        raise ConfigError("this lmcache_svc client has no memory methods (server too old)")
    return client

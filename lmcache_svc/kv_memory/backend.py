"""Where memories live: the four calls ``KVCacheMemory`` makes, and two implementations.

``service_backend`` gives a ``CacheClient``, whose memory methods talk to a running
lmcache-svc server (gRPC ``MemoryService``), so every process and engine that reaches the
server sees the same memories. ``InProcessBackend`` wraps the server's own ``MemoryStore``
for one tenant in this process (same checks and semantics: same bytes again is a no-op,
other bytes under a stored id a ``Conflict``), for unit tests and single-process use.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

from lmcache_svc.client import MemoryInfo
from lmcache_svc.errors import ConfigError
from lmcache_svc.server.memories.store import MemoryStore

DEFAULT_IN_PROCESS_BYTES = 1 << 40


class MemoryBackend(Protocol):
    def put_memory(self, blob: bytes) -> MemoryInfo: ...

    def get_memory(self, memory_id: str) -> bytes | None: ...

    def list_memories(self) -> list[MemoryInfo]: ...

    def delete_memory(self, memory_id: str) -> bool: ...


class InProcessBackend:
    def __init__(self, capacity_bytes: int = DEFAULT_IN_PROCESS_BYTES) -> None:
        self._store = MemoryStore(capacity_bytes=capacity_bytes, max_bytes=capacity_bytes)
        self._tenant = "default"

    def put_memory(self, blob: bytes) -> MemoryInfo:
        return self._store.put(self._tenant, blob)[0]

    def get_memory(self, memory_id: str) -> bytes | None:
        return self._store.get(self._tenant, memory_id)

    def list_memories(self) -> list[MemoryInfo]:
        return self._store.list(self._tenant)

    def delete_memory(self, memory_id: str) -> bool:
        return self._store.delete(self._tenant, memory_id)


def service_backend(address: str, auth_token: str | None, tenant: str | None) -> Any:
    """A ``CacheClient`` (it has the four memory methods) for the server at ``address``."""
    from lmcache_svc.client import CacheClient

    kwargs: dict[str, Any] = {"auth_token": auth_token, "client_name": "kv-cache-memory"}
    if tenant is not None:
        if "tenant" not in inspect.signature(CacheClient.__init__).parameters:
            raise ConfigError(
                "tenant is set but this client cannot name one: the server picks the tenant "
                "from the auth token (leave tenant unset)"
            )
        kwargs["tenant"] = tenant
    return CacheClient(address, **kwargs)

"""Which lookup-index segments a gRPC session gets: those of the tenants its caller may use.

The auth interceptor notes the caller of ``OpenSession`` (``note_caller``, a context
variable of the call's task); the servicer then lists, after the arena, the index tables
of that caller's tenant, or of every tenant for an admin token or when authentication is
off (no interceptor: nothing noted). A tenant's session never learns the name of another
tenant's table.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from lmcache_svc.cache import TieredCache
from lmcache_svc.server.auth import Principal
from lmcache_svc.shm.lookup_index import INDEX_TRANSPORT
from lmcache_svc.v1 import cache_pb2 as pb

_CALLER: ContextVar[Principal | None] = ContextVar("lmcache_svc_session_caller", default=None)


def note_caller(principal: Principal, cache: TieredCache, request: Any) -> None:
    """An interceptor check for OpenSession: remember who opens the session."""
    _CALLER.set(principal)


def index_segments(cache: TieredCache) -> list[pb.Segment]:
    """The index segments of the current OpenSession's caller (none without an index)."""
    publisher = cache.lookup_index
    if publisher is None:
        return []
    caller = _CALLER.get()
    tenant = caller.tenant if caller is not None else None
    return [
        pb.Segment(transport=INDEX_TRANSPORT, name=s.name, size=s.size, nonce=s.nonce)
        for s in publisher.segments_for(tenant)
    ]

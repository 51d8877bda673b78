"""gRPC authentication and per-tenant access, as one server interceptor.

The interceptor authenticates the ``authorization`` metadata, then wraps the method's
handler so the decoded request is checked before the servicer sees it: the namespace a call
names must belong to the token's tenant (``Principal.check_namespace``), registrations must
name that tenant, Stats needs an admin token, writes a token that is not read-only. A method
missing from ``_POLICIES`` needs an admin token (a new RPC is closed until it is listed).
Health checks are open.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from lmcache_svc.cache import TieredCache
from lmcache_svc.errors import LMCacheSvcError
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.auth import Principal
from lmcache_svc.server.grpc.index_segments import note_caller
from lmcache_svc.server.status import grpc_code
from lmcache_svc.server.tokens import Authenticator
from lmcache_svc.wire import ERROR_KIND_KEY, namespace_from_pb

_SERVICE = "/lmcache_svc.v1.CacheService/"
_MEMORY_SERVICE = "/lmcache_svc.v1.MemoryService/"
_HEALTH = "/grpc.health.v1.Health/"

Check = Callable[[Principal, TieredCache, Any], None]


def _own_namespace_id(principal: Principal, cache: TieredCache, request: Any) -> None:
    principal.check_namespace(cache.namespace(request.namespace_id))


def _register(principal: Principal, cache: TieredCache, request: Any) -> None:
    principal.check_register(namespace_from_pb(request.namespace))


def _anyone(principal: Principal, cache: TieredCache, request: Any) -> None:
    return None


@dataclass(frozen=True, slots=True)
class _Policy:
    check: Check
    admin: bool = False
    write: bool = False


_CACHE_POLICIES: dict[str, _Policy] = {
    "RegisterNamespace": _Policy(_register),
    "OpenSession": _Policy(note_caller),  # its lookup-index tables: the caller's tenant
    "Lookup": _Policy(_own_namespace_id),
    # the lookups it answered from the index; a read-only token's are not counted
    "ReportLookups": _Policy(_own_namespace_id, write=True),
    "PrepareStore": _Policy(_own_namespace_id, write=True),
    "CommitStore": _Policy(_own_namespace_id, write=True),
    "PrepareLoad": _Policy(_own_namespace_id),
    "ReleaseLoad": _Policy(_anyone),
    "TouchChunks": _Policy(_own_namespace_id),  # reads, as PrepareLoad's
    "Put": _Policy(_own_namespace_id, write=True),  # checked on every chunk header
    "Get": _Policy(_own_namespace_id),
    "Delete": _Policy(_own_namespace_id, write=True),
    "Stats": _Policy(_anyone, admin=True),
}
_MEMORY_POLICIES: dict[str, _Policy] = {  # each call acts for the caller's own tenant
    "PutMemory": _Policy(_anyone, write=True),
    "GetMemory": _Policy(_anyone),
    "ListMemories": _Policy(_anyone),
    "DeleteMemory": _Policy(_anyone, write=True),
}
_POLICIES: dict[str, _Policy] = {
    **{_SERVICE + name: p for name, p in _CACHE_POLICIES.items()},
    **{_MEMORY_SERVICE + name: p for name, p in _MEMORY_POLICIES.items()},
}
"""Full method path -> policy; a method not listed needs an admin token."""
_ADMIN_ONLY = _Policy(_anyone, admin=True)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticate every call except health checks; enforce ``_POLICIES``."""

    def __init__(self, auth: Authenticator, cache: TieredCache) -> None:
        self._auth, self._cache = auth, cache

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        method: str = details.method
        if method.startswith(_HEALTH):
            return await continuation(details)
        header = dict(details.invocation_metadata or ()).get("authorization")
        name = method.rsplit("/", 1)[-1]
        policy = _POLICIES.get(method, _ADMIN_ONLY)
        handler = await continuation(details)
        if handler is None:
            return None
        try:
            principal = self._auth.authenticate(header)
            if policy.admin:
                principal.check_admin(name)
            if policy.write:
                principal.check_write(name)
        except LMCacheSvcError as e:
            self._cache.metrics.errors.labels(kind=e.kind).inc()
            return _refuse(handler, e)
        if policy.check is _anyone:
            return handler
        return _guard(handler, _Guard(policy.check, principal, self._cache))


@dataclass(frozen=True, slots=True)
class _Guard:
    check: Check
    principal: Principal
    cache: TieredCache

    def __call__(self, request: Any) -> None:
        self.check(self.principal, self.cache, request)

    @property
    def metrics(self) -> Metrics:
        return self.cache.metrics


def _guard(handler: grpc.RpcMethodHandler, guard: _Guard) -> grpc.RpcMethodHandler:
    """``handler`` with ``guard`` run on its request (each chunk header, for Put)."""
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await _checked(guard, request, context)
            return await inner_uu(request, context)

        return handler._replace(unary_unary=unary_unary)  # type: ignore[attr-defined,no-any-return]
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await _checked(guard, request, context)
            async for item in inner_us(request, context):
                yield item

        return handler._replace(unary_stream=unary_stream)  # type: ignore[attr-defined,no-any-return]
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        async def stream_unary(requests: AsyncIterator[Any], context: Any) -> Any:
            return await inner_su(_checked_headers(guard, requests), context)

        return handler._replace(stream_unary=stream_unary)  # type: ignore[attr-defined,no-any-return]
    raise TypeError("no bidirectional-streaming method is expected on this service")


async def _checked(guard: _Guard, request: Any, context: grpc.aio.ServicerContext) -> None:
    try:
        guard(request)
    except LMCacheSvcError as e:
        guard.metrics.errors.labels(kind=e.kind).inc()
        context.set_trailing_metadata(((ERROR_KIND_KEY, e.kind),))
        await context.abort(grpc_code(e), str(e))


async def _checked_headers(guard: _Guard, parts: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """Put's chunk parts, each header checked; the servicer reports an error raised here."""
    async for part in parts:
        if part.HasField("header"):
            guard(part.header)
        yield part


def _refuse(handler: grpc.RpcMethodHandler, error: LMCacheSvcError) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour replaced by an abort with ``error`` (same call shape)."""

    async def abort(context: grpc.aio.ServicerContext) -> None:
        context.set_trailing_metadata(((ERROR_KIND_KEY, error.kind),))
        await context.abort(grpc_code(error), str(error))

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        await abort(context)

    async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort(context)
        yield  # pragma: no cover (abort raises); makes this an async generator

    if handler.unary_unary is not None:
        return handler._replace(unary_unary=unary)  # type: ignore[attr-defined,no-any-return]
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=unary_stream)  # type: ignore[attr-defined,no-any-return]
    if handler.stream_unary is not None:
        return handler._replace(stream_unary=unary)  # type: ignore[attr-defined,no-any-return]
    return handler._replace(stream_stream=unary_stream)  # type: ignore[attr-defined,no-any-return]

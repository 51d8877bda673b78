"""REST transport: a thin FastAPI adapter from HTTP requests to ``TieredCache`` calls.

Handlers that touch the cache are plain ``def`` (FastAPI runs them in its thread pool; the
cache is thread-safe and blocking). Bodies are the pydantic models of ``http_models``;
authentication, the body limit, metrics and error bodies live in ``http_edge``. Endpoints,
status codes and a curl example for each are in ``docs/rest.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import uvicorn
from fastapi import Depends, FastAPI, Path, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from lmcache_svc import __version__
from lmcache_svc.cache import TieredCache
from lmcache_svc.errors import (
    ConfigError,
    InvalidArgument,
    LMCacheSvcError,
    NoSpace,
    NotFound,
    PayloadTooLarge,
    SizeMismatch,
)
from lmcache_svc.keys import (
    ChunkHash,
    Namespace,
    chunk_hashes,
    parse_chunk_hash,
    parse_namespace_id,
)
from lmcache_svc.memories.store import MemoryStore
from lmcache_svc.server.http_edge import (
    OPEN_PATHS,
    Edge,
    content_length,
    error_response,
    on_http_error,
    on_service_error,
    on_validation_error,
)
from lmcache_svc.server.http_memories import add_memory_routes
from lmcache_svc.server.http_models import (
    ErrorResponse,
    KeysRequest,
    KeysResponse,
    LookupRequest,
    LookupResponse,
    NamespaceModel,
    RegisterResponse,
    StatsResponse,
    StatusResponse,
    StoreResponse,
    TierStatsModel,
    error_responses,
)

TIER_HEADER = "X-LMCache-Tier"
OCTET_STREAM = "application/octet-stream"
_CHUNK_PATH = "/v1/chunks/{namespace_id}/{chunk_hash}"
_BINARY = {OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}}}

# -- per-app state and request helpers -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class _State:
    cache: TieredCache
    max_body_bytes: int
    ready: Callable[[], bool]


def _state(request: Request) -> _State:
    state: _State = request.app.state.lmcache
    return state


State = Annotated[_State, Depends(_state)]


@dataclass(frozen=True, slots=True)
class _Target:
    namespace: Namespace
    chunk_hash: ChunkHash

    def missing(self) -> NotFound:
        return NotFound(
            f"chunk {self.chunk_hash.hex()} is not stored in namespace "
            f"{self.namespace.namespace_id.hex()}"
        )


async def _target(
    state: State,
    namespace_id: Annotated[str, Path(description="namespace id, 32 hex characters")],
    chunk_hash: Annotated[str, Path(description="chunk hash, 64 hex characters")],
) -> _Target:
    ns_id = parse_namespace_id(namespace_id)
    hash_ = parse_chunk_hash(chunk_hash)
    return _Target(state.cache.namespace(ns_id), hash_)


Target = Annotated[_Target, Depends(_target)]


async def _chunk_body(request: Request, state: State, target: Target) -> bytearray:
    """The request body, checked against the chunk size before and while it is read."""
    ns = target.namespace
    expected = ns.chunk_bytes
    if expected > state.max_body_bytes:
        raise PayloadTooLarge(
            f"namespace {ns.namespace_id.hex()} stores chunks of {expected} bytes, over this "
            f"server's body limit of {state.max_body_bytes} bytes"
        )
    declared = content_length(request.headers)
    if declared is not None and declared != expected:
        raise _size_mismatch(ns, f"{declared} bytes (Content-Length)")
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > expected:
                raise _size_mismatch(ns, f"at least {len(body)} bytes")
    except ClientDisconnect:
        raise InvalidArgument("the client went away before sending the whole body") from None
    if len(body) != expected:
        raise _size_mismatch(ns, f"{len(body)} bytes")
    return body


def _size_mismatch(ns: Namespace, got: str) -> SizeMismatch:
    return SizeMismatch(
        f"body is {got}; namespace {ns.namespace_id.hex()} stores chunks of exactly "
        f"{ns.chunk_bytes} bytes"
    )


# -- endpoints ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _RouteSpec:
    method: str
    path: str
    endpoint: Callable[..., Any]
    options: dict[str, Any]


_ROUTES: list[_RouteSpec] = []
"""The route table, filled at import by ``_route``; ``create_app`` adds each route to its app
(directly, so ``Edge`` can name the route of a request it refuses before routing)."""

_Endpoint = TypeVar("_Endpoint", bound=Callable[..., Any])


def _route(method: str, path: str, **options: Any) -> Callable[[_Endpoint], _Endpoint]:
    def record(endpoint: _Endpoint) -> _Endpoint:
        _ROUTES.append(_RouteSpec(method, path, endpoint, options))
        return endpoint

    return record


@_route(
    "POST",
    "/v1/namespaces",
    summary="Register a namespace",
    tags=["namespaces"],
    responses=error_responses(400),
)
def register_namespace(state: State, body: NamespaceModel) -> RegisterResponse:
    ns = state.cache.register_namespace(body.to_namespace())
    return RegisterResponse(namespace_id=ns.namespace_id.hex(), chunk_bytes=ns.chunk_bytes)


@_route(
    "POST",
    "/v1/keys",
    summary="Chained chunk hashes of token ids",
    tags=["namespaces"],
    responses=error_responses(400, 404, 413),
)
def compute_keys(state: State, body: KeysRequest) -> KeysResponse:
    if (body.namespace is None) == (body.namespace_id is None):
        raise InvalidArgument("give exactly one of 'namespace' and 'namespace_id'")
    if body.namespace is not None:
        ns = body.namespace.to_namespace()
    else:
        ns = state.cache.namespace(parse_namespace_id(body.namespace_id or ""))
    max_tokens = state.cache.settings.max_chunks_per_request * ns.chunk_size
    if len(body.token_ids) > max_tokens:
        raise PayloadTooLarge(f"{len(body.token_ids)} token ids; the limit is {max_tokens}")
    hashes = chunk_hashes(ns, body.token_ids, include_partial=body.include_partial)
    return KeysResponse(
        namespace_id=ns.namespace_id.hex(),
        chunk_size=ns.chunk_size,
        chunk_hashes=[h.hex() for h in hashes],
    )


@_route(
    "PUT",
    _CHUNK_PATH,
    summary="Store one chunk",
    tags=["chunks"],
    status_code=201,
    response_model=StoreResponse,
    responses={
        200: {"model": StoreResponse, "description": "Already stored"},
        **error_responses(400, 404, 409, 413, 507),
    },
    openapi_extra={"requestBody": {"required": True, "content": _BINARY}},
)
def put_chunk(
    request: Request,
    state: State,
    target: Target,
    body: Annotated[bytearray, Depends(_chunk_body)],
) -> Response:
    ns_id = target.namespace.namespace_id
    status = state.cache.put(ns_id, target.chunk_hash, body)
    if status == "no_space":
        raise NoSpace(
            f"no room for a {len(body)}-byte chunk: the first tier is full of "
            "pinned or reserved chunks"
        )
    if status == "in_progress":
        message = f"chunk {target.chunk_hash.hex()} is being stored by another client"
        return error_response(request.scope, 409, "in_progress", message)
    stored = status == "reserved"
    return JSONResponse(
        {"status": "stored" if stored else "already_stored"}, status_code=201 if stored else 200
    )


@_route(
    "GET",
    _CHUNK_PATH,
    summary="Read one chunk",
    tags=["chunks"],
    response_class=Response,
    responses={
        200: {
            "content": _BINARY,
            "description": f"Chunk bytes; {TIER_HEADER}: the tier it came from",
        },
        **error_responses(400, 404),
    },
)
def get_chunk(state: State, target: Target) -> Response:
    found = state.cache.get(target.namespace.namespace_id, target.chunk_hash)
    if found is None:
        raise target.missing()
    data, tier = found
    return Response(data, media_type=OCTET_STREAM, headers={TIER_HEADER: tier})


@_route(
    "HEAD",
    _CHUNK_PATH,
    summary="Whether a chunk is stored, its size and tier",
    tags=["chunks"],
    response_class=Response,
    responses=error_responses(400, 404),
)
def head_chunk(state: State, target: Target) -> Response:
    tier = state.cache.contains(target.namespace.namespace_id, target.chunk_hash)
    if tier is None:
        raise target.missing()
    size = str(target.namespace.chunk_bytes)
    return Response(media_type=OCTET_STREAM, headers={"Content-Length": size, TIER_HEADER: tier})


@_route(
    "DELETE",
    _CHUNK_PATH,
    summary="Delete one chunk from every tier",
    tags=["chunks"],
    status_code=204,
    response_class=Response,
    responses=error_responses(400, 404),
)
def delete_chunk(state: State, target: Target) -> Response:
    if not state.cache.delete(target.namespace.namespace_id, [target.chunk_hash]):
        raise target.missing()
    return Response(status_code=204)


@_route(
    "POST",
    "/v1/lookup",
    summary="Longest stored prefix of a chunk sequence",
    tags=["chunks"],
    responses=error_responses(400, 404, 413),
)
def lookup(state: State, body: LookupRequest) -> LookupResponse:
    ns_id = parse_namespace_id(body.namespace_id)
    hashes = [_parse_listed_hash(i, h) for i, h in enumerate(body.chunk_hashes)]
    result = state.cache.lookup(ns_id, hashes)
    return LookupResponse(num_hit_chunks=result.num_hit_chunks, tiers=result.tiers)


def _parse_listed_hash(index: int, value: str) -> ChunkHash:
    try:
        return parse_chunk_hash(value)
    except InvalidArgument as e:
        raise InvalidArgument(f"chunk_hashes[{index}]: {e}") from None


@_route("GET", "/v1/stats", summary="Tier usage, leases and namespaces", tags=["operations"])
def stats(state: State) -> StatsResponse:
    s = state.cache.stats()
    return StatsResponse(
        tiers=[
            TierStatsModel(
                name=t.name,
                capacity_bytes=t.capacity_bytes,
                used_bytes=t.used_bytes,
                num_chunks=t.num_chunks,
            )
            for t in s.tiers
        ],
        active_leases=s.active_leases,
        pending_stores=s.pending_stores,
        num_namespaces=s.num_namespaces,
    )


@_route(
    "GET",
    "/metrics",
    summary="Prometheus metrics",
    tags=["operations"],
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
)
def metrics(state: State) -> Response:
    return Response(state.cache.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@_route("GET", "/healthz", summary="Liveness: 200 while the process serves", tags=["health"])
async def healthz() -> StatusResponse:
    return StatusResponse(status="ok")


@_route(
    "GET",
    "/readyz",
    summary="Readiness: 200 when ready to serve traffic, else 503",
    tags=["health"],
    responses={200: {"model": StatusResponse}, 503: {"model": ErrorResponse}},
)
async def readyz(request: Request, state: State) -> Response:
    if not state.ready():
        return error_response(request.scope, 503, "not_ready", "the server is not ready yet")
    return JSONResponse({"status": "ready"})


# -- construction ---------------------------------------------------------------------------


def create_app(
    cache: TieredCache,
    *,
    auth_token: str | None = None,
    max_body_bytes: int,
    ready: Callable[[], bool] = lambda: True,
    memories: MemoryStore | None = None,
) -> FastAPI:
    """The REST app over ``cache`` (and ``memories``, when given: ``/v1/memories``);
    ``auth_token`` None turns authentication off."""
    if auth_token == "":
        raise ConfigError("auth token must be non-empty (or None to turn authentication off)")
    if (
        isinstance(max_body_bytes, bool)
        or not isinstance(max_body_bytes, int)
        or (max_body_bytes <= 0)
    ):
        raise ConfigError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
    app = FastAPI(
        title="lmcache-svc",
        version=__version__,
        summary="KV-cache service: namespaces, chunk keys and chunk bytes over REST",
        generate_unique_id_function=_operation_id,
    )
    app.state.lmcache = _State(cache, max_body_bytes, ready)
    # Authentication is enforced by Edge (it also covers /docs and /openapi.json); the
    # HTTPBearer dependency only declares the scheme in the OpenAPI document.
    bearer = [Depends(HTTPBearer(auto_error=False))] if auth_token is not None else []
    for spec in _ROUTES:
        app.add_api_route(
            spec.path,
            spec.endpoint,
            methods=[spec.method],
            **spec.options,
            dependencies=[] if spec.path in OPEN_PATHS else bearer,
        )
    if memories is not None:
        add_memory_routes(app, memories, dependencies=bearer)
    app.add_exception_handler(LMCacheSvcError, on_service_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_middleware(
        Edge,
        router=app.router,
        metrics=cache.metrics,
        auth_token=auth_token,
        max_body_bytes=max_body_bytes,
    )
    return app


def _operation_id(route: APIRoute) -> str:
    return route.name  # put_chunk, not put_chunk_v1_chunks__namespace_id___chunk_hash__put


def make_uvicorn_server(app: FastAPI, host: str, port: int) -> uvicorn.Server:
    """A uvicorn server for ``app``: warnings only, no access log."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    return uvicorn.Server(config)

"""REST transport: a thin FastAPI adapter from HTTP requests to ``TieredCache`` calls.

Handlers that touch the cache are plain ``def`` (FastAPI runs them in its thread pool; the
cache is thread-safe and blocking). JSON bodies are the pydantic models of ``http_models``,
read whole (``http_edge`` bounds them by ``max_json_bytes``) and parsed and validated in the
thread pool, never on the event loop (``_json_body``). Every namespace a request names goes
through ``Principal.check_namespace``/``check_register`` (the token's tenant). Authentication,
route policy, body limits, metrics and error bodies live in ``http_edge``; connection limits
in ``http_server``. Endpoints, status codes and a curl example for each are in
``docs/rest.md``; the trust model in ``docs/security.md``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import uvicorn
from fastapi import Depends, FastAPI, Path, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
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
from lmcache_svc.server.auth import Principal
from lmcache_svc.server.http_edge import (
    OPEN_PATHS,
    Edge,
    Limits,
    RoutePolicy,
    content_length,
    error_response,
    on_http_error,
    on_service_error,
    on_validation_error,
    principal,
)
from lmcache_svc.server.http_memories import add_memory_routes
from lmcache_svc.server.http_models import (
    CHUNK_HASH_PATTERN,
    NAMESPACE_ID_PATTERN,
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
    error_responses,
)
from lmcache_svc.server.http_server import ConnectionLimits, make_uvicorn_config
from lmcache_svc.server.stats import stats_fields
from lmcache_svc.server.tokens import Authenticator, make_authenticator

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


def _principal(request: Request) -> Principal:
    return principal(request.scope)


Caller = Annotated[Principal, Depends(_principal)]

_Model = TypeVar("_Model", bound=BaseModel)
_JSON_MODELS: list[type[BaseModel]] = []
"""Request models read by ``_json_body``; ``create_app`` adds their schemas to the document."""


def _json_body(model: type[_Model]) -> Callable[[Request], Awaitable[_Model]]:
    """A dependency giving the body as ``model``: read whole (bounded by ``http_edge``), then
    parsed and validated in the thread pool, so a large body never stalls the event loop."""

    async def parse(request: Request) -> _Model:
        raw = await request.body()
        try:
            return await run_in_threadpool(model.model_validate_json, raw)
        except ValidationError as e:
            errors = [
                {"loc": ("body", *err["loc"]), "msg": err["msg"], "type": err["type"]}
                for err in e.errors(include_url=False, include_input=False)
            ]
            raise RequestValidationError(errors) from None

    _JSON_MODELS.append(model)
    return parse


def _json_request(model: type[BaseModel]) -> dict[str, Any]:
    """The route option documenting a ``_json_body`` request body."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    content = {"application/json": {"schema": ref}}
    return {"openapi_extra": {"requestBody": {"required": True, "content": content}}}


@dataclass(frozen=True, slots=True)
class _Target:
    namespace: Namespace
    chunk_hash: ChunkHash

    def missing(self) -> NotFound:
        return NotFound(
            f"chunk {self.chunk_hash.hex()} is not stored in namespace "
            f"{self.namespace.namespace_id.hex()}"
        )


def own_namespace(state: _State, caller: Principal, namespace_id: str) -> Namespace:
    """The registered namespace of this hex id, if the caller's tenant may use it (else the
    same 404 as an unregistered id)."""
    return caller.check_namespace(state.cache.namespace(parse_namespace_id(namespace_id)))


async def _target(
    state: State,
    caller: Caller,
    namespace_id: Annotated[
        str,
        Path(
            description="namespace id, 32 hex characters",
            json_schema_extra={"pattern": NAMESPACE_ID_PATTERN},
        ),
    ],
    chunk_hash: Annotated[
        str,
        Path(
            description="chunk hash, 64 hex characters",
            json_schema_extra={"pattern": CHUNK_HASH_PATTERN},
        ),
    ],
) -> _Target:
    ns = own_namespace(state, caller, namespace_id)
    return _Target(ns, parse_chunk_hash(chunk_hash))


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
    responses=error_responses(400, 403, 413, 507),
    **_json_request(NamespaceModel),
)
def register_namespace(
    state: State,
    caller: Caller,
    body: Annotated[NamespaceModel, Depends(_json_body(NamespaceModel))],
) -> RegisterResponse:
    ns = body.to_namespace()
    caller.check_register(ns)
    ns = state.cache.register_namespace(ns)
    return RegisterResponse(namespace_id=ns.namespace_id.hex(), chunk_bytes=ns.chunk_bytes)


@_route(
    "POST",
    "/v1/keys",
    summary="Chained chunk hashes of token ids",
    tags=["namespaces"],
    responses=error_responses(400, 403, 404, 413),
    **_json_request(KeysRequest),
)
def compute_keys(
    state: State,
    caller: Caller,
    body: Annotated[KeysRequest, Depends(_json_body(KeysRequest))],
) -> KeysResponse:
    if (body.namespace is None) == (body.namespace_id is None):
        raise InvalidArgument("give exactly one of 'namespace' and 'namespace_id'")
    if body.namespace is not None:
        ns = body.namespace.to_namespace()
        caller.check_register(ns)
    else:
        ns = own_namespace(state, caller, body.namespace_id or "")
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
    **_json_request(LookupRequest),
)
def lookup(
    state: State,
    caller: Caller,
    body: Annotated[LookupRequest, Depends(_json_body(LookupRequest))],
) -> LookupResponse:
    ns = own_namespace(state, caller, body.namespace_id)
    hashes = [_parse_listed_hash(i, h) for i, h in enumerate(body.chunk_hashes)]
    result = state.cache.lookup(ns.namespace_id, hashes)
    return LookupResponse(num_hit_chunks=result.num_hit_chunks, tiers=result.tiers)


def _parse_listed_hash(index: int, value: str) -> ChunkHash:
    try:
        return parse_chunk_hash(value)
    except InvalidArgument as e:
        raise InvalidArgument(f"chunk_hashes[{index}]: {e}") from None


@_route("GET", "/v1/stats", summary="Tier usage, leases and namespaces", tags=["operations"])
def stats(state: State) -> StatsResponse:
    return StatsResponse.model_validate(stats_fields(state.cache))


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

POLICY = RoutePolicy(
    admin=frozenset({"stats", "metrics"}),
    write=frozenset({"put_chunk", "delete_chunk", "put_memory", "delete_memory"}),
    chunk_body=frozenset({"put_chunk", "put_memory"}),
)
DEFAULT_MAX_JSON_BYTES = 4 << 20


def create_app(
    cache: TieredCache,
    *,
    auth_token: str | None = None,
    auth: Authenticator | None = None,
    max_body_bytes: int,
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES,
    body_idle_timeout_s: float | None = None,
    ready: Callable[[], bool] = lambda: True,
    memories: MemoryStore | None = None,
) -> FastAPI:
    """The REST app over ``cache`` (and ``memories``, when given: ``/v1/memories``).
    Authentication is off unless ``auth`` is given (or ``auth_token``, an admin token,
    without it)."""
    if auth_token == "":
        raise ConfigError("auth token must be non-empty (or None to turn authentication off)")
    for name, value in (("max_body_bytes", max_body_bytes), ("max_json_bytes", max_json_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    auth = auth or make_authenticator(auth_token)
    app = FastAPI(
        title="lmcache-svc",
        version=__version__,
        summary="KV-cache service: namespaces, chunk keys and chunk bytes over REST",
        generate_unique_id_function=_operation_id,
    )
    app.state.lmcache = _State(cache, max_body_bytes, ready)
    _add_routes(app, secured=auth is not None)
    _document_json_bodies(app)
    if memories is not None:
        bearer = [Depends(HTTPBearer(auto_error=False))] if auth is not None else []
        add_memory_routes(app, memories, dependencies=bearer)
    app.add_exception_handler(LMCacheSvcError, on_service_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_middleware(
        Edge,
        router=app.router,
        metrics=cache.metrics,
        auth=auth,
        policy=POLICY,
        limits=Limits(max_body_bytes, max_json_bytes, body_idle_timeout_s),
    )
    return app


def _add_routes(app: FastAPI, *, secured: bool) -> None:
    # Authentication is enforced by Edge (it also covers /docs and /openapi.json); the
    # HTTPBearer dependency only declares the scheme in the OpenAPI document.
    bearer = [Depends(HTTPBearer(auto_error=False))] if secured else []
    for spec in _ROUTES:
        options = dict(spec.options)
        is_open = spec.path in OPEN_PATHS
        if secured and not is_open:
            name = spec.endpoint.__name__
            refusals = [401, 403] if name in POLICY.admin | POLICY.write else [401]
            options["responses"] = {
                **options.get("responses", {}),
                **{s: {"model": ErrorResponse} for s in refusals},
            }
        app.add_api_route(
            spec.path,
            spec.endpoint,
            methods=[spec.method],
            **options,
            dependencies=[] if is_open else bearer,
        )


def _document_json_bodies(app: FastAPI) -> None:
    """Put the schemas of ``_json_body`` request models into the OpenAPI components."""
    make_document = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = make_document()
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for model in _JSON_MODELS:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def _operation_id(route: APIRoute) -> str:
    return route.name  # put_chunk, not put_chunk_v1_chunks__namespace_id___chunk_hash__put


def make_uvicorn_server(
    app: FastAPI, host: str, port: int, limits: ConnectionLimits | None = None
) -> uvicorn.Server:
    """A uvicorn server for ``app``: warnings only, no access log, ``limits`` applied."""
    return uvicorn.Server(
        make_uvicorn_config(app, limits or ConnectionLimits(), host=host, port=port)
    )

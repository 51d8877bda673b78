"""REST transport: a thin FastAPI adapter from HTTP requests to ``TieredCache`` calls.

``create_app`` builds the app from the route modules, one per concept: ``http.namespaces``
(register, keys), ``http.chunks`` (chunk bytes, lookup), ``http.operations`` (stats,
metrics, health) and ``http.memories``; ``http.routing`` holds what they share. Handlers
that touch the cache are plain ``def`` (FastAPI runs them in its thread pool; the cache is
thread-safe and blocking). JSON bodies are the pydantic models of ``http.models``, read
whole (``http.edge`` bounds them by ``max_json_bytes``) and parsed and validated in the
thread pool, never on the event loop (``http.routing.json_body``). Every namespace a request
names goes through ``Principal.check_namespace``/``check_register`` (the token's tenant).
Authentication, route policy, body limits, metrics and error bodies live in ``http.edge``;
connection limits in ``http.server``. Endpoints, status codes and a curl example for each
are in ``docs/rest.md``; the trust model in ``docs/security.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from starlette.exceptions import HTTPException

from lmcache_svc import __version__
from lmcache_svc.cache import TieredCache
from lmcache_svc.errors import ConfigError, LMCacheSvcError
from lmcache_svc.server.http import chunks, namespaces, operations
from lmcache_svc.server.http.edge import (
    OPEN_PATHS,
    Edge,
    Limits,
    RoutePolicy,
    on_http_error,
    on_service_error,
    on_validation_error,
)
from lmcache_svc.server.http.memories import add_memory_routes
from lmcache_svc.server.http.models import ErrorResponse
from lmcache_svc.server.http.routing import JSON_MODELS, AppState, RouteSpec
from lmcache_svc.server.http.server import ConnectionLimits, make_uvicorn_config
from lmcache_svc.server.memories.store import MemoryStore
from lmcache_svc.server.tokens import Authenticator, make_authenticator

_ROUTES: list[RouteSpec] = [
    *namespaces.ROUTES.specs,
    *chunks.ROUTES.specs,
    *operations.ROUTES.specs,
]
"""Every chunk-cache route, in the order the OpenAPI document lists them."""

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
    app.state.lmcache = AppState(cache, max_body_bytes, ready)
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
    """Put the schemas of ``json_body`` request models into the OpenAPI components."""
    make_document = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = make_document()
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for model in JSON_MODELS:
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

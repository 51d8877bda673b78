"""What every REST route module shares: the per-app state and the caller as request
dependencies, JSON bodies parsed off the event loop, the namespace check, and the
``RouteTable`` each route module fills at import (``api.create_app`` adds the routes)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from lmcache_svc.cache import TieredCache
from lmcache_svc.keys import Namespace, parse_namespace_id
from lmcache_svc.server.auth import Principal
from lmcache_svc.server.http.edge import principal

# -- per-app state and request helpers -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class AppState:
    cache: TieredCache
    max_body_bytes: int
    ready: Callable[[], bool]


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.lmcache
    return state


State = Annotated[AppState, Depends(_state)]


def _principal(request: Request) -> Principal:
    return principal(request.scope)


Caller = Annotated[Principal, Depends(_principal)]

_Model = TypeVar("_Model", bound=BaseModel)
JSON_MODELS: list[type[BaseModel]] = []
"""Request models read by ``json_body``; ``create_app`` adds their schemas to the document."""


def json_body(model: type[_Model]) -> Callable[[Request], Awaitable[_Model]]:
    """A dependency giving the body as ``model``: read whole (bounded by ``http.edge``), then
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

    JSON_MODELS.append(model)
    return parse


def json_request(model: type[BaseModel]) -> dict[str, Any]:
    """The route option documenting a ``json_body`` request body."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    content = {"application/json": {"schema": ref}}
    return {"openapi_extra": {"requestBody": {"required": True, "content": content}}}


def own_namespace(state: AppState, caller: Principal, namespace_id: str) -> Namespace:
    """The registered namespace of this hex id, if the caller's tenant may use it (else the
    same 404 as an unregistered id)."""
    return caller.check_namespace(state.cache.namespace(parse_namespace_id(namespace_id)))


# -- the route table -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RouteSpec:
    method: str
    path: str
    endpoint: Callable[..., Any]
    options: dict[str, Any]


_Endpoint = TypeVar("_Endpoint", bound=Callable[..., Any])


class RouteTable:
    """Routes recorded at import by ``route``; ``create_app`` adds each to its app (directly,
    so ``Edge`` can name the route of a request it refuses before routing)."""

    def __init__(self) -> None:
        self.specs: list[RouteSpec] = []

    def route(self, method: str, path: str, **options: Any) -> Callable[[_Endpoint], _Endpoint]:
        def record(endpoint: _Endpoint) -> _Endpoint:
            self.specs.append(RouteSpec(method, path, endpoint, options))
            return endpoint

        return record

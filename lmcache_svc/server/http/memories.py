"""REST endpoints of the named memories (``/v1/memories``), added to the app by
``create_app`` when it is given a ``MemoryStore``.

Every call acts for the caller's tenant (``tenancy.py``). A memory is created from its raw
safetensors bytes (``application/octet-stream``) and read back as the same bytes. Ids in
paths are plain strings checked by the store, so a malformed one is our 400. Endpoints,
statuses and curl examples are in ``docs/rest.md``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, FastAPI, Path, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from pydantic.json_schema import JsonDict
from starlette.concurrency import run_in_threadpool

from lmcache_svc.errors import NotFound, PayloadTooLarge
from lmcache_svc.memory_blob import MemoryInfo
from lmcache_svc.server.http.edge import content_length, principal, read_body
from lmcache_svc.server.http.models import BINARY_CONTENT, OCTET_STREAM, error_responses
from lmcache_svc.server.memories.store import MemoryStore
from lmcache_svc.server.tenancy import caller_tenant

_ITEM_PATH = "/v1/memories/{memory_id}"
_TAGS: list[str | Any] = ["memories"]
_UUID_PATTERN = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
_UUID_SCHEMA: JsonDict = {"format": "uuid", "pattern": _UUID_PATTERN}
"""Documented, not validated by FastAPI: the store checks ids, so a bad one is our 400."""


class MemoryModel(BaseModel):
    memory_id: str = Field(
        description="the memory's UUID, canonical lowercase form", json_schema_extra=_UUID_SCHEMA
    )
    size_bytes: int = Field(ge=0, description="size of the whole safetensors blob")
    model: str = Field(description="model identity recorded in the blob")
    metadata: dict[str, Any] = Field(description="the item's metadata (a JSON object)")

    @classmethod
    def of(cls, info: MemoryInfo) -> MemoryModel:
        return cls(
            memory_id=info.memory_id,
            size_bytes=info.size_bytes,
            model=info.model,
            metadata=info.metadata,
        )


class MemoryListResponse(BaseModel):
    memories: list[MemoryModel] = Field(description="the caller's memories, ordered by id")


def _store(request: Request) -> MemoryStore:
    store: MemoryStore = request.app.state.lmcache_memories
    return store


def _tenant(request: Request) -> str:
    return caller_tenant(principal(request.scope))


Store = Annotated[MemoryStore, Depends(_store)]
Tenant = Annotated[str, Depends(_tenant)]
MemoryId = Annotated[
    str,
    Path(
        description="the memory's UUID, canonical lowercase form (anything else is a 400)",
        json_schema_extra=_UUID_SCHEMA,
    ),
]


async def _memory_body(request: Request, store: Store) -> bytearray:
    """The request body, refused as soon as it is known to exceed ``memory.max_bytes``."""
    declared = content_length(request.headers)
    if declared is not None and declared > store.max_bytes:
        raise _too_large(f"{declared} bytes (Content-Length)", store.max_bytes)
    return await read_body(request, store.max_bytes, lambda got: _too_large(got, store.max_bytes))


def _too_large(got: str, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"memory body is {got}, over memory.max_bytes ({limit})")


async def put_memory(
    store: Store, tenant: Tenant, body: Annotated[bytearray, Depends(_memory_body)]
) -> Response:
    info, created = await run_in_threadpool(store.put, tenant, body)
    payload = MemoryModel.of(info).model_dump(mode="json")
    return JSONResponse(payload, status_code=201 if created else 200)


def list_memories(store: Store, tenant: Tenant) -> MemoryListResponse:
    return MemoryListResponse(memories=[MemoryModel.of(i) for i in store.list(tenant)])


def get_memory(store: Store, tenant: Tenant, memory_id: MemoryId) -> Response:
    blob = store.get(tenant, memory_id)
    if blob is None:
        raise _missing(memory_id)
    return Response(blob, media_type=OCTET_STREAM)


def head_memory(store: Store, tenant: Tenant, memory_id: MemoryId) -> Response:
    if store.info(tenant, memory_id) is None:
        raise _missing(memory_id)
    return Response(status_code=204)


def delete_memory(store: Store, tenant: Tenant, memory_id: MemoryId) -> Response:
    if not store.delete(tenant, memory_id):
        raise _missing(memory_id)
    return Response(status_code=204)


def _missing(memory_id: str) -> NotFound:
    return NotFound(f"memory {memory_id} is not stored for this tenant")


_ROUTES: list[tuple[str, str, Any, dict[str, Any]]] = [
    (
        "POST",
        "/v1/memories",
        put_memory,
        {
            "summary": "Store a memory (a safetensors blob); the same bytes again is a no-op",
            "status_code": 201,
            "response_model": MemoryModel,
            "responses": {
                200: {"model": MemoryModel, "description": "Already stored with these bytes"},
                **error_responses(400, 409, 413, 507),
            },
            "openapi_extra": {"requestBody": {"required": True, "content": BINARY_CONTENT}},
        },
    ),
    ("GET", "/v1/memories", list_memories, {"summary": "The caller's memories"}),
    (
        "GET",
        _ITEM_PATH,
        get_memory,
        {
            "summary": "A memory's safetensors bytes",
            "response_class": Response,
            "responses": {
                200: {"content": BINARY_CONTENT, "description": "The blob as stored"},
                **error_responses(400, 404),
            },
        },
    ),
    (
        "HEAD",
        _ITEM_PATH,
        head_memory,
        {
            "summary": "Whether a memory is stored",
            "status_code": 204,
            "response_class": Response,
            "responses": error_responses(400, 404),
        },
    ),
    (
        "DELETE",
        _ITEM_PATH,
        delete_memory,
        {
            "summary": "Delete a memory",
            "status_code": 204,
            "response_class": Response,
            "responses": error_responses(400, 404),
        },
    ),
]


def add_memory_routes(app: FastAPI, store: MemoryStore, dependencies: list[Any]) -> None:
    """Serve ``/v1/memories`` from ``store`` on ``app``; ``dependencies`` declare auth."""
    app.state.lmcache_memories = store
    for method, path, endpoint, options in _ROUTES:
        app.add_api_route(
            path, endpoint, methods=[method], tags=_TAGS, dependencies=dependencies, **options
        )

"""Request and response bodies of the REST API (``server/http.py``), as pydantic models.

Ids and hashes travel as hex strings; they are plain ``str`` here and parsed by the handlers,
so a malformed one is our 400 (``InvalidArgument``), not a 422 validation error.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from lmcache_svc.keys import DEFAULT_CHUNK_SIZE, KEY_FORMAT_VERSION, MAX_FIELD_VALUE, Namespace


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _bounded(low: int, **options: Any) -> Any:
    """An integer field's documented range. ``keys.Namespace`` enforces it, so a value out
    of range is a 400 naming the field (a wrong type stays a 422)."""
    return Field(json_schema_extra={"minimum": low, "maximum": MAX_FIELD_VALUE}, **options)


class KVLayoutModel(StrictModel):
    dtype: StrictStr = Field(examples=["bfloat16"])
    num_layers: StrictInt = _bounded(1)
    num_kv_heads: StrictInt = _bounded(1, description="KV heads held by this tensor-parallel rank")
    head_size: StrictInt = _bounded(1)
    block_size: StrictInt = _bounded(1)
    page_layout: StrictStr = Field(examples=["vllm-cpu/NHC"])
    kv_planes: StrictInt = Field(2, description="2 for separate K and V, 1 for MLA")


class NamespaceModel(StrictModel):
    """``Namespace.to_dict()`` form. ``chunk_size`` times the layout's bytes per token (the
    namespace's ``chunk_bytes``) must not exceed the server's ``max_body_bytes``."""

    model: StrictStr
    layout: KVLayoutModel
    chunk_size: StrictInt = _bounded(1, default=DEFAULT_CHUNK_SIZE)
    tp_rank: StrictInt = _bounded(0, default=0)
    tp_size: StrictInt = _bounded(1, default=1)
    tenant: StrictStr = "default"
    key_version: StrictInt = KEY_FORMAT_VERSION

    def to_namespace(self) -> Namespace:
        return Namespace.from_dict(self.model_dump())


NAMESPACE_ID_PATTERN = "^[0-9a-fA-F]{32}$"
CHUNK_HASH_PATTERN = "^[0-9a-fA-F]{64}$"

TokenId = Annotated[StrictInt, Field(ge=0, le=2**32 - 1)]
# The patterns document the format; the handlers parse ids and hashes themselves, so a bad
# one is our 400 naming the field, not a 422.
HexNamespaceId = Annotated[
    str,
    Field(
        description="namespace id, 32 hex characters",
        json_schema_extra={"pattern": NAMESPACE_ID_PATTERN},
    ),
]
HexChunkHash = Annotated[
    str,
    Field(
        description="chunk hash, 64 hex characters",
        json_schema_extra={"pattern": CHUNK_HASH_PATTERN},
    ),
]


class RegisterResponse(BaseModel):
    namespace_id: HexNamespaceId
    chunk_bytes: int = Field(description="exact size of one chunk's bytes in this namespace")


class KeysRequest(StrictModel):
    namespace: NamespaceModel | None = Field(None, description="inline; not registered")
    namespace_id: HexNamespaceId | None = Field(None, description="a registered namespace")
    token_ids: list[TokenId]
    include_partial: StrictBool = Field(False, description="also hash a last partial chunk")


class KeysResponse(BaseModel):
    namespace_id: HexNamespaceId
    chunk_size: int
    chunk_hashes: list[HexChunkHash]


class StoreResponse(BaseModel):
    status: Literal["stored", "already_stored"]


class LookupRequest(StrictModel):
    namespace_id: HexNamespaceId
    chunk_hashes: list[HexChunkHash]


class LookupResponse(BaseModel):
    num_hit_chunks: int = Field(description="length of the contiguous prefix found")
    tiers: list[str] = Field(description="tier holding each chunk of that prefix")


class TierStatsModel(BaseModel):
    name: str
    capacity_bytes: int
    used_bytes: int
    num_chunks: int


class StatsResponse(BaseModel):
    tiers: list[TierStatsModel]
    active_leases: int
    pending_stores: int
    num_namespaces: int


class StatusResponse(BaseModel):
    status: str


class ErrorResponse(BaseModel):
    error: str = Field(description="error kind, e.g. invalid_argument, not_found, no_space")
    message: str
    detail: list[dict[str, Any]] | None = Field(None, description="validation errors (422)")


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for these error statuses (422 always included)."""
    return {s: {"model": ErrorResponse} for s in (*statuses, 422)}

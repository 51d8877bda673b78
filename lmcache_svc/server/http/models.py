"""Request and response bodies of the REST API (``server/http/api.py``), as pydantic models.

Ids and hashes travel as hex strings; they are plain ``str`` here and parsed by the handlers,
so a malformed one is our 400 (``InvalidArgument``), not a 422 validation error.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, create_model

from lmcache_svc.keys import MAX_FIELD_VALUE, KVLayout, Namespace


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NamespaceBody(StrictModel):
    """Base of the generated ``NamespaceModel``: its way back to ``keys.Namespace``."""

    def to_namespace(self) -> Namespace:
        return Namespace.from_dict(self.model_dump())


def _field(f: dataclasses.Field[Any], types: dict[str, Any]) -> tuple[Any, Any]:
    """A dataclass field as a pydantic field: strict type, default, and the documented range
    (``keys.documented``). ``keys.Namespace`` enforces the range, so a value out of it is a
    400 naming the field (a wrong type stays a 422)."""
    if f.type not in types:
        raise TypeError(f"no REST type for {f.name}: {f.type}")
    low = f.metadata.get("minimum")
    extra = None if low is None else {"minimum": low, "maximum": MAX_FIELD_VALUE}
    default = ... if f.default is dataclasses.MISSING else f.default
    info = Field(
        default,
        description=f.metadata.get("description"),
        examples=f.metadata.get("examples"),
        json_schema_extra=extra,
    )
    return types[f.type], info


def _model_of(cls: type, base: type[StrictModel], types: dict[str, Any], doc: str | None) -> Any:
    """The REST model of a ``keys`` dataclass, generated from its fields (one source)."""
    body: dict[str, Any] = {f.name: _field(f, types) for f in dataclasses.fields(cls) if f.init}
    return create_model(f"{cls.__name__}Model", __base__=base, __doc__=doc, **body)


if TYPE_CHECKING:
    KVLayoutModel = StrictModel
    NamespaceModel = NamespaceBody
else:
    _SCALARS = {"str": StrictStr, "int": StrictInt}
    KVLayoutModel = _model_of(KVLayout, StrictModel, _SCALARS, None)
    NamespaceModel = _model_of(
        Namespace,
        NamespaceBody,
        {**_SCALARS, "KVLayout": KVLayoutModel},
        """``Namespace.to_dict()`` form. ``chunk_size`` times the layout's bytes per token (the
namespace's ``chunk_bytes``) must not exceed the server's ``max_body_bytes``.""",
    )


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


OCTET_STREAM = "application/octet-stream"
BINARY_CONTENT = {OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}}}
"""OpenAPI ``content`` of a raw-bytes body (chunks, memories)."""


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for these error statuses (422 always included)."""
    return {s: {"model": ErrorResponse} for s in (*statuses, 422)}

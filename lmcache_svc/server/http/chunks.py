"""REST routes of chunks: store, read, probe and delete one chunk
(``/v1/chunks/{namespace_id}/{chunk_hash}``) and look up the longest stored prefix of a
sequence (``POST /v1/lookup``). A chunk body is raw bytes, checked against the namespace's
chunk size before and while it is read."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, Path, Request, Response
from fastapi.responses import JSONResponse

from lmcache_svc.errors import InvalidArgument, NoSpace, NotFound, PayloadTooLarge, SizeMismatch
from lmcache_svc.keys import ChunkHash, Namespace, parse_chunk_hash
from lmcache_svc.server.http.edge import content_length, error_response, read_body
from lmcache_svc.server.http.models import (
    BINARY_CONTENT,
    CHUNK_HASH_PATTERN,
    NAMESPACE_ID_PATTERN,
    OCTET_STREAM,
    LookupRequest,
    LookupResponse,
    StoreResponse,
    error_responses,
)
from lmcache_svc.server.http.routing import (
    Caller,
    RouteTable,
    State,
    json_body,
    json_request,
    own_namespace,
)

TIER_HEADER = "X-LMCache-Tier"
TOKENS_HEADER = "X-LMCache-Token-Ids"
PARENT_HEADER = "X-LMCache-Parent-Hash"
_TOKENS_PATTERN = r"^[0-9]+(,[0-9]+)*$"
MAX_TOKEN_ID = 2**32 - 1
_CHUNK_PATH = "/v1/chunks/{namespace_id}/{chunk_hash}"

ROUTES = RouteTable()


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
    body = await read_body(request, expected, lambda got: _size_mismatch(ns, got))
    if len(body) != expected:
        raise _size_mismatch(ns, f"{len(body)} bytes")
    return body


@dataclass(frozen=True, slots=True)
class _Described:
    """A stored chunk's token ids (little-endian uint32) and parent hash, for the KV events
    (docs/events.md); no tokens: not described."""

    token_ids: bytes
    parent_hash: bytes


def _described(
    target: Target,
    token_ids: Annotated[
        str | None,
        Header(
            alias=TOKENS_HEADER,
            description="the chunk's token ids, comma-separated (for the KV events)",
            json_schema_extra={"pattern": _TOKENS_PATTERN},
        ),
    ] = None,
    parent_hash: Annotated[
        str | None,
        Header(
            alias=PARENT_HEADER,
            description="the chunk before it, 64 hex characters (none for a sequence's first)",
            json_schema_extra={"pattern": CHUNK_HASH_PATTERN},
        ),
    ] = None,
) -> _Described:
    if token_ids is None:
        if parent_hash is not None:
            raise InvalidArgument(f"{PARENT_HEADER} without {TOKENS_HEADER}")
        return _Described(b"", b"")
    chunk_size = target.namespace.chunk_size
    if token_ids.count(",") + 1 != chunk_size:  # before parsing: the header is not bounded
        raise InvalidArgument(
            f"{TOKENS_HEADER}: {token_ids.count(',') + 1} token ids for a chunk of {chunk_size}"
        )
    try:
        ids = [int(t) for t in token_ids.split(",")]
    except ValueError:
        raise InvalidArgument(f"{TOKENS_HEADER}: not a comma-separated list of token ids") from None
    if any(not 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise InvalidArgument(f"{TOKENS_HEADER}: a token id out of 0..{MAX_TOKEN_ID}")
    try:
        parent = parse_chunk_hash(parent_hash) if parent_hash is not None else b""
    except InvalidArgument as e:
        raise InvalidArgument(f"{PARENT_HEADER}: {e}") from None
    return _Described(struct.pack(f"<{len(ids)}I", *ids), parent)


def _size_mismatch(ns: Namespace, got: str) -> SizeMismatch:
    return SizeMismatch(
        f"body is {got}; namespace {ns.namespace_id.hex()} stores chunks of exactly "
        f"{ns.chunk_bytes} bytes"
    )


@ROUTES.route(
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
    openapi_extra={"requestBody": {"required": True, "content": BINARY_CONTENT}},
)
def put_chunk(
    request: Request,
    state: State,
    target: Target,
    described: Annotated[_Described, Depends(_described)],  # checked before the body is read
    body: Annotated[bytearray, Depends(_chunk_body)],
) -> Response:
    ns_id = target.namespace.namespace_id
    status = state.cache.put(
        ns_id, target.chunk_hash, body, token_ids=described.token_ids,
        parent_hash=described.parent_hash,
    )  # fmt: skip
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


@ROUTES.route(
    "GET",
    _CHUNK_PATH,
    summary="Read one chunk",
    tags=["chunks"],
    response_class=Response,
    responses={
        200: {
            "content": BINARY_CONTENT,
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


@ROUTES.route(
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


@ROUTES.route(
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


@ROUTES.route(
    "POST",
    "/v1/lookup",
    summary="Longest stored prefix of a chunk sequence",
    tags=["chunks"],
    responses=error_responses(400, 404, 413),
    **json_request(LookupRequest),
)
def lookup(
    state: State,
    caller: Caller,
    body: Annotated[LookupRequest, Depends(json_body(LookupRequest))],
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

"""REST routes of namespaces: register one (``POST /v1/namespaces``) and compute chained
chunk hashes of token ids (``POST /v1/keys``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends

from lmcache_svc.errors import InvalidArgument, PayloadTooLarge
from lmcache_svc.keys import chunk_hashes
from lmcache_svc.server.http.models import (
    KeysRequest,
    KeysResponse,
    NamespaceModel,
    RegisterResponse,
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

ROUTES = RouteTable()


@ROUTES.route(
    "POST",
    "/v1/namespaces",
    summary="Register a namespace",
    tags=["namespaces"],
    responses=error_responses(400, 403, 413, 507),
    **json_request(NamespaceModel),
)
def register_namespace(
    state: State,
    caller: Caller,
    body: Annotated[NamespaceModel, Depends(json_body(NamespaceModel))],
) -> RegisterResponse:
    ns = body.to_namespace()
    caller.check_register(ns)
    ns = state.cache.register_namespace(ns)
    return RegisterResponse(namespace_id=ns.namespace_id.hex(), chunk_bytes=ns.chunk_bytes)


@ROUTES.route(
    "POST",
    "/v1/keys",
    summary="Chained chunk hashes of token ids",
    tags=["namespaces"],
    responses=error_responses(400, 403, 404, 413),
    **json_request(KeysRequest),
)
def compute_keys(
    state: State,
    caller: Caller,
    body: Annotated[KeysRequest, Depends(json_body(KeysRequest))],
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

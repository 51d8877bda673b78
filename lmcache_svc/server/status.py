"""The one place where the project's exceptions become gRPC status codes and HTTP statuses.

Tiers and the cache raise ``lmcache_svc.errors`` classes; both transports ask this module how
to report them. The table is ordered most specific class first, and the first ``isinstance``
match wins, so a subclass (``UnknownNamespace``) can answer differently from its base
(``InvalidArgument``). Anything not in the table, including exceptions that are not ours,
is ``INTERNAL`` / 500.

Choices worth knowing:

- ``SizeMismatch`` is 400 (the body is malformed for this namespace), not 422.
- ``UnknownNamespace`` is ``INVALID_ARGUMENT`` over gRPC but 404 over HTTP, where the
  namespace id is part of the resource path.
- ``PayloadTooLarge`` is ``INVALID_ARGUMENT`` / 413: the caller must split the request,
  retrying it unchanged will not help (so not ``RESOURCE_EXHAUSTED``).
- ``NoSpace`` is ``RESOURCE_EXHAUSTED`` / 507: retry later, when leases are released.
- ``TooManyNamespaces`` is ``RESOURCE_EXHAUSTED`` / 507 too: the server's namespace table
  is full (``cache.max_namespaces``); already registered namespaces keep working.
- ``TierError`` (and ``Corrupted``) is ``UNAVAILABLE`` / 503.
- ``Conflict`` is ``ALREADY_EXISTS`` / 409: a memory id already stored with other bytes.
- ``MemoryCorrupted`` is ``DATA_LOSS`` / 500: a stored memory failed its checksum; it is
  quarantined (a retry finds no such memory), so not 503, which clients retry.
- ``TooBusy`` is ``RESOURCE_EXHAUSTED`` / 429: too many memory transfers at once; retry.
"""

from __future__ import annotations

import grpc

from lmcache_svc.errors import (
    BodyTimeout,
    Conflict,
    InvalidArgument,
    LMCacheSvcError,
    MemoryCorrupted,
    NoSpace,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    SizeMismatch,
    TierError,
    TooBusy,
    TooManyNamespaces,
    Unauthenticated,
    UnknownNamespace,
)

INTERNAL_KIND = "internal"

_TABLE: tuple[tuple[type[LMCacheSvcError], grpc.StatusCode, int], ...] = (
    (UnknownNamespace, grpc.StatusCode.INVALID_ARGUMENT, 404),
    (SizeMismatch, grpc.StatusCode.INVALID_ARGUMENT, 400),
    (BodyTimeout, grpc.StatusCode.DEADLINE_EXCEEDED, 408),
    (PayloadTooLarge, grpc.StatusCode.INVALID_ARGUMENT, 413),
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, 400),
    (NotFound, grpc.StatusCode.NOT_FOUND, 404),
    (Conflict, grpc.StatusCode.ALREADY_EXISTS, 409),
    (NoSpace, grpc.StatusCode.RESOURCE_EXHAUSTED, 507),
    (TooManyNamespaces, grpc.StatusCode.RESOURCE_EXHAUSTED, 507),
    (TooBusy, grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED, 401),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED, 403),
    (MemoryCorrupted, grpc.StatusCode.DATA_LOSS, 500),
    (TierError, grpc.StatusCode.UNAVAILABLE, 503),
)


def _lookup(exc: BaseException) -> tuple[grpc.StatusCode, int]:
    for cls, code, status in _TABLE:
        if isinstance(exc, cls):
            return code, status
    return grpc.StatusCode.INTERNAL, 500


def grpc_code(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code that reports ``exc`` to a client."""
    return _lookup(exc)[0]


def http_status(exc: BaseException) -> int:
    """The HTTP status that reports ``exc`` to a client."""
    return _lookup(exc)[1]


def error_kind(exc: BaseException) -> str:
    """The ``kind`` label of ``exc`` (``errors.py``), or ``"internal"`` for foreign ones."""
    return exc.kind if isinstance(exc, LMCacheSvcError) else INTERNAL_KIND

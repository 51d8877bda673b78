"""Conversions between protobuf messages and the domain types, shared by client and server.

Errors cross the wire as a gRPC status code plus the error's ``kind`` in the trailing
metadata key ``lmcache-error-kind``, so a client raises the same exception class the server
raised (``error_from_kind``).
"""

from __future__ import annotations

import json
from dataclasses import asdict

from lmcache_svc import errors
from lmcache_svc.keys import KVLayout, Namespace
from lmcache_svc.memories.format import MemoryInfo
from lmcache_svc.tiers.base import MEDIA, Medium
from lmcache_svc.v1 import cache_pb2 as pb

ERROR_KIND_KEY = "lmcache-error-kind"
MAX_MESSAGE_BYTES = 64 << 20
PIECE_BYTES = 4 << 20
"""Inline chunk bytes travel in pieces of at most this size."""

_ERRORS_BY_KIND: dict[str, type[errors.LMCacheSvcError]] = {
    cls.kind: cls
    for cls in (
        errors.InvalidArgument,
        errors.UnknownNamespace,
        errors.SizeMismatch,
        errors.BadMemory,
        errors.Conflict,
        errors.PayloadTooLarge,
        errors.NotFound,
        errors.UnknownSession,
        errors.ReservationExpired,
        errors.NoSpace,
        errors.TooManyNamespaces,
        errors.ReservationLimit,
        errors.Unauthenticated,
        errors.PermissionDenied,
        errors.BodyTimeout,
        errors.ConfigError,
        errors.TierError,
        errors.Corrupted,
    )
}


def error_from_kind(kind: str, message: str) -> errors.LMCacheSvcError:
    return _ERRORS_BY_KIND.get(kind, errors.LMCacheSvcError)(message)


def namespace_to_pb(ns: Namespace) -> pb.Namespace:
    return pb.Namespace(
        model=ns.model,
        layout=pb.KVLayout(**asdict(ns.layout)),
        chunk_size=ns.chunk_size,
        tp_rank=ns.tp_rank,
        tp_size=ns.tp_size,
        tenant=ns.tenant,
        key_version=ns.key_version,
    )


def namespace_from_pb(msg: pb.Namespace) -> Namespace:
    if not msg.HasField("layout"):
        raise errors.InvalidArgument("namespace is missing its layout")
    lay = msg.layout
    layout = KVLayout(
        dtype=lay.dtype,
        num_layers=lay.num_layers,
        num_kv_heads=lay.num_kv_heads,
        head_size=lay.head_size,
        block_size=lay.block_size,
        page_layout=lay.page_layout,
        kv_planes=lay.kv_planes,
    )
    return Namespace(
        model=msg.model,
        layout=layout,
        chunk_size=msg.chunk_size,
        tp_rank=msg.tp_rank,
        tp_size=msg.tp_size,
        tenant=msg.tenant,
        key_version=msg.key_version,
    )


def channel_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]


def memory_info_to_pb(info: MemoryInfo) -> pb.MemoryInfo:
    return pb.MemoryInfo(
        memory_id=info.memory_id,
        size_bytes=info.size_bytes,
        model=info.model,
        metadata_json=json.dumps(info.metadata),
    )


def memory_info_from_pb(msg: pb.MemoryInfo) -> MemoryInfo:
    metadata = json.loads(msg.metadata_json) if msg.metadata_json else {}
    return MemoryInfo(msg.memory_id, int(msg.size_bytes), msg.model, metadata)


def medium_to_pb(medium: Medium) -> pb.Medium:
    return pb.Medium.Value("MEDIUM_" + medium.upper())


def medium_from_pb(value: int) -> Medium:
    """The medium a server sent; ``InvalidArgument`` for one this client does not know."""
    medium = _MEDIA_BY_PB.get(value)
    if medium is None:
        raise errors.InvalidArgument(f"unknown tier medium {value} in a lookup answer")
    return medium


_MEDIA_BY_PB: dict[int, Medium] = {medium_to_pb(m): m for m in MEDIA}

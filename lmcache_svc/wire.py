"""Conversions between protobuf messages and the domain types, shared by client and server.

Errors cross the wire as a gRPC status code plus the error's ``kind`` in the trailing
metadata key ``lmcache-error-kind``, so a client raises the same exception class the server
raised (``error_from_kind``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import fields
from typing import Any

from google.protobuf.message import Message

from lmcache_svc import errors
from lmcache_svc.keys import KVLayout, Namespace
from lmcache_svc.memory_blob import MemoryInfo
from lmcache_svc.results import StoreStatus
from lmcache_svc.tiers.base import MEDIA, Medium
from lmcache_svc.v1 import cache_pb2 as pb

ERROR_KIND_KEY = "lmcache-error-kind"
MAX_MESSAGE_BYTES = 64 << 20
PIECE_BYTES = 4 << 20
"""Inline chunk bytes travel in pieces of at most this size."""


def _error_classes(
    base: type[errors.LMCacheSvcError],
) -> Iterator[type[errors.LMCacheSvcError]]:
    """``base`` and every class below it in the exception tree (``errors.py``)."""
    yield base
    for sub in base.__subclasses__():
        yield from _error_classes(sub)


def _errors_by_kind() -> dict[str, type[errors.LMCacheSvcError]]:
    table: dict[str, type[errors.LMCacheSvcError]] = {}
    for cls in _error_classes(errors.LMCacheSvcError):
        if table.setdefault(cls.kind, cls) is not cls:
            raise TypeError(
                f"{cls.__name__} and {table[cls.kind].__name__} share kind {cls.kind!r}"
            )
    return table


_ERRORS_BY_KIND = _errors_by_kind()
"""Each exception class of ``errors.py`` by its ``kind``, derived from the tree itself."""

STORE_STATUS_CODES: dict[StoreStatus, pb.StoreStatus] = {
    "reserved": pb.RESERVED,
    "already_stored": pb.ALREADY_STORED,
    "no_space": pb.NO_SPACE,
    "in_progress": pb.IN_PROGRESS,
}
"""``prepare_store``'s answer per chunk as the wire's enum (the server sends, the client
reads ``STORE_STATUS_NAMES``)."""
STORE_STATUS_NAMES: dict[int, StoreStatus] = {v: k for k, v in STORE_STATUS_CODES.items()}


def error_from_kind(kind: str, message: str) -> errors.LMCacheSvcError:
    """The exception the server raised, from the kind it sent (the base class for a kind this
    client does not know, e.g. from a newer server)."""
    return _ERRORS_BY_KIND.get(kind, errors.LMCacheSvcError)(message)


def namespace_to_pb(ns: Namespace) -> pb.Namespace:
    """The message of ``ns``: the proto's field names are the dataclasses' (``keys.py``)."""
    return pb.Namespace(**ns.to_dict())


def namespace_from_pb(msg: pb.Namespace) -> Namespace:
    if not msg.HasField("layout"):
        raise errors.InvalidArgument("namespace is missing its layout")
    layout = KVLayout(**_init_fields(KVLayout, msg.layout))
    return Namespace(**{**_init_fields(Namespace, msg), "layout": layout})


def _init_fields(cls: type[KVLayout] | type[Namespace], msg: Message) -> dict[str, Any]:
    """The values of ``msg``'s fields named like ``cls``'s constructor arguments."""
    return {f.name: getattr(msg, f.name) for f in fields(cls) if f.init}


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

"""Every RPC of the generated servicer base classes (``lmcache_svc/v1/cache_pb2_grpc.py``,
protoc's output: each method there answers UNIMPLEMENTED) is defined again by the server's
own servicer, so no call of the protocol can reach protoc's placeholder."""

from __future__ import annotations

import inspect

import pytest

from lmcache_svc.server.grpc.cache_service import CacheServicer
from lmcache_svc.server.grpc.memory_service import MemoryServicer
from lmcache_svc.v1 import cache_pb2, cache_pb2_grpc


def _rpcs(service_name: str) -> list[str]:
    return [m.name for m in cache_pb2.DESCRIPTOR.services_by_name[service_name].methods]


@pytest.mark.parametrize(
    ("service", "base", "servicer"),
    [
        ("CacheService", cache_pb2_grpc.CacheServiceServicer, CacheServicer),
        ("MemoryService", cache_pb2_grpc.MemoryServiceServicer, MemoryServicer),
    ],
)
def test_every_rpc_is_served_not_left_to_the_generated_placeholder(
    service: str, base: type, servicer: type
) -> None:
    rpcs = _rpcs(service)
    assert rpcs and all(inspect.isfunction(getattr(base, name)) for name in rpcs)
    placeholders = [name for name in rpcs if getattr(servicer, name) is getattr(base, name)]
    assert not placeholders, f"{servicer.__name__} leaves {placeholders} UNIMPLEMENTED"

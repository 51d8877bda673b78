"""The asyncio Python client of the cache server (inline transfers, for tools and remote
callers); see ``client.py`` for the blocking client with the shared-memory path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from lmcache_svc import errors
from lmcache_svc.keys import Namespace, NamespaceId
from lmcache_svc.rpc import (
    GetAssembler,
    LookupResult,
    auth_metadata,
    client_channel_options,
    convert_rpc_error,
    grpc_target,
    put_parts,
    stats_dict,
)
from lmcache_svc.v1 import cache_pb2 as pb
from lmcache_svc.v1 import cache_pb2_grpc as pb_grpc
from lmcache_svc.wire import namespace_to_pb


class AsyncCacheClient:
    """asyncio client over inline transfers (for tools and remote callers)."""

    def __init__(
        self, address: str, *, timeout_s: float = 5.0, auth_token: str | None = None
    ) -> None:
        self._target = grpc_target(address)
        self.timeout_s = timeout_s
        self._metadata = auth_metadata(auth_token)
        self._channel = grpc.aio.insecure_channel(self._target, options=client_channel_options())
        self._stub = pb_grpc.CacheServiceStub(self._channel)
        self._namespaces: dict[bytes, Namespace] = {}

    async def __aenter__(self) -> AsyncCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: str, request: Any) -> Any:
        try:
            return await getattr(self._stub, method)(
                request, timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise convert_rpc_error(e) from None

    async def _ns_call(self, method: str, request: Any) -> Any:
        try:
            return await self._call(method, request)
        except errors.UnknownNamespace:
            ns = self._namespaces.get(bytes(request.namespace_id))
            if ns is None:
                raise
            await self.register_namespace(ns)
            return await self._call(method, request)

    async def register_namespace(self, namespace: Namespace) -> NamespaceId:
        resp = await self._call(
            "RegisterNamespace", pb.RegisterNamespaceRequest(namespace=namespace_to_pb(namespace))
        )
        self._namespaces[bytes(resp.namespace_id)] = namespace
        return NamespaceId(bytes(resp.namespace_id))

    async def lookup(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> LookupResult:
        resp = await self._ns_call(
            "Lookup", pb.LookupRequest(namespace_id=namespace_id, chunk_hashes=chunk_hashes)
        )
        return LookupResult(resp.num_hit_chunks, list(resp.tiers))

    async def put(self, namespace_id: bytes, items: Sequence[tuple[bytes, Any]]) -> int:
        try:
            resp = await self._stub.Put(
                put_parts(namespace_id, items),
                timeout=self.timeout_s * max(1, len(items)),
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            raise convert_rpc_error(e) from None
        return int(resp.num_stored)

    async def get(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> list[bytes | None]:
        assembler = GetAssembler()
        try:
            call = self._stub.Get(
                pb.GetRequest(namespace_id=namespace_id, chunk_hashes=chunk_hashes),
                timeout=self.timeout_s * max(1, len(chunk_hashes)),
                metadata=self._metadata,
            )
            async for part in call:
                assembler.feed(part)
        except grpc.RpcError as e:
            raise convert_rpc_error(e) from None
        return assembler.result()

    async def delete(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> int:
        resp = await self._ns_call(
            "Delete", pb.DeleteRequest(namespace_id=namespace_id, chunk_hashes=chunk_hashes)
        )
        return int(resp.num_deleted)

    async def stats(self) -> dict[str, Any]:
        return stats_dict(await self._call("Stats", pb.StatsRequest()))

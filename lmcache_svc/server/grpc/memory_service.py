"""The gRPC MemoryService: named memories over the same server as CacheService.

A thin adapter to ``MemoryStore`` calls, which may touch the disk and so run in threads.
Every call acts for the caller's tenant (``tenancy.py``). Errors are reported like
CacheService's: a status code plus the error kind in trailing metadata.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from lmcache_svc.errors import InvalidArgument, LMCacheSvcError, PayloadTooLarge
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.grpc.calls import unary_rpc
from lmcache_svc.server.memories.store import MemoryStore
from lmcache_svc.server.status import grpc_code
from lmcache_svc.server.tenancy import caller_tenant
from lmcache_svc.server.tokens import Authenticator, principal_of
from lmcache_svc.v1 import cache_pb2 as pb
from lmcache_svc.v1 import cache_pb2_grpc as pb_grpc
from lmcache_svc.wire import ERROR_KIND_KEY, PIECE_BYTES, memory_info_to_pb


class MemoryServicer(pb_grpc.MemoryServiceServicer):
    def __init__(self, store: MemoryStore, metrics: Metrics, auth: Authenticator | None) -> None:
        self._store = store
        self._metrics = metrics
        self._auth = auth

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's tenant (its token was already checked by the auth interceptor)."""
        header = dict(context.invocation_metadata() or ()).get("authorization")
        return caller_tenant(principal_of(self._auth, header if isinstance(header, str) else None))

    @unary_rpc
    async def PutMemory(
        self, request_iterator: AsyncIterator[pb.MemoryPart], context: grpc.aio.ServicerContext
    ) -> pb.PutMemoryResponse:
        blob = await self._receive_blob(request_iterator)
        info, created = await asyncio.to_thread(self._store.put, self._tenant(context), blob)
        return pb.PutMemoryResponse(memory=memory_info_to_pb(info), created=created)

    async def _receive_blob(self, request_iterator: AsyncIterator[pb.MemoryPart]) -> bytearray:
        length: int | None = None
        blob = bytearray()
        async for part in request_iterator:
            if part.HasField("header"):
                if length is not None:
                    raise InvalidArgument("PutMemory stream sent a second header")
                length = int(part.header.length)
                if length > self._store.max_bytes:
                    raise PayloadTooLarge(
                        f"memory of {length} bytes is over memory.max_bytes "
                        f"({self._store.max_bytes})"
                    )
            elif length is None:
                raise InvalidArgument("PutMemory stream sent data before its header")
            else:
                blob += part.data
                if len(blob) > length:
                    raise InvalidArgument(f"memory data runs past its header's {length} bytes")
        if length is None or len(blob) != length:
            raise InvalidArgument(f"PutMemory stream ended after {len(blob)} of {length} bytes")
        return blob

    async def GetMemory(
        self, request: pb.GetMemoryRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.MemoryPart]:
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            tenant = self._tenant(context)
            blob = await asyncio.to_thread(self._store.get, tenant, request.memory_id)
            if blob is None:
                yield pb.MemoryPart(header=pb.MemoryHeader(found=False))
                return
            yield pb.MemoryPart(header=pb.MemoryHeader(length=len(blob), found=True))
            for i in range(0, len(blob), PIECE_BYTES):
                yield pb.MemoryPart(data=blob[i : i + PIECE_BYTES])
        except LMCacheSvcError as e:
            code = grpc_code(e)
            self._metrics.errors.labels(kind=e.kind).inc()
            context.set_trailing_metadata(((ERROR_KIND_KEY, e.kind),))
            await context.abort(code, str(e))
        finally:
            self._metrics.requests.labels(
                transport="grpc", method="GetMemory", code=code.name
            ).inc()
            self._metrics.request_latency.labels(transport="grpc", method="GetMemory").observe(
                time.perf_counter() - start
            )

    @unary_rpc
    async def ListMemories(
        self, request: pb.ListMemoriesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListMemoriesResponse:
        infos = self._store.list(self._tenant(context))
        return pb.ListMemoriesResponse(memories=[memory_info_to_pb(i) for i in infos])

    @unary_rpc
    async def DeleteMemory(
        self, request: pb.DeleteMemoryRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteMemoryResponse:
        deleted = await asyncio.to_thread(
            self._store.delete, self._tenant(context), request.memory_id
        )
        return pb.DeleteMemoryResponse(deleted=deleted)


def add_memory_service(
    server: grpc.aio.Server, store: MemoryStore, metrics: Metrics, auth: Authenticator | None
) -> None:
    """Serve ``MemoryService`` on ``server`` (before it starts)."""
    pb_grpc.add_MemoryServiceServicer_to_server(MemoryServicer(store, metrics, auth), server)

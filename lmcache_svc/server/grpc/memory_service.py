"""The gRPC MemoryService: named memories over the same server as CacheService.

A thin adapter to ``MemoryStore`` calls; every store call (lists included) runs in a
thread, never on the event loop, since it may touch the disk or wait for the store's lock.
Every call acts for the caller's tenant (``tenancy.py``). ``GetMemory`` streams the verified
blob in pieces read from the store one at a time (a read holds one piece, not the blob); a
memory whose bytes changed after they were verified ends the stream with ``DATA_LOSS``.
Reads and uploads in flight are capped (``memory.max_transfers``: ``RESOURCE_EXHAUSTED``).
Errors are reported like CacheService's: a status code plus the error kind in trailing
metadata.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import grpc

from lmcache_svc.errors import InvalidArgument, LMCacheSvcError, PayloadTooLarge
from lmcache_svc.memory_blob import PREFIX_BYTES, header_length
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.grpc.calls import unary_rpc
from lmcache_svc.server.memories.integrity import MemoryRead
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
        releases: list[Callable[[], None]] = []
        try:
            blob = await self._receive_blob(request_iterator, releases)
            info, created = await asyncio.to_thread(self._store.put, self._tenant(context), blob)
        finally:
            for release in releases:
                release()
        return pb.PutMemoryResponse(memory=memory_info_to_pb(info), created=created)

    async def _receive_blob(
        self, request_iterator: AsyncIterator[pb.MemoryPart], releases: list[Callable[[], None]]
    ) -> bytearray:
        """The uploaded blob; the upload counts as a transfer from its header on. A blob
        whose 8-byte prefix announces a header over the limit is refused as soon as the
        prefix arrives, not after the whole blob."""
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
                releases.append(self._store.transfer("an upload of a memory"))
            elif length is None:
                raise InvalidArgument("PutMemory stream sent data before its header")
            else:
                checked = len(blob) >= PREFIX_BYTES
                blob += part.data
                if len(blob) > length:
                    raise InvalidArgument(f"memory data runs past its header's {length} bytes")
                if not checked and len(blob) >= PREFIX_BYTES:
                    header_length(bytes(blob[:PREFIX_BYTES]), length)
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
            read = await asyncio.to_thread(self._store.open, tenant, request.memory_id)
            if read is None:
                yield pb.MemoryPart(header=pb.MemoryHeader(found=False))
                return
            try:
                yield pb.MemoryPart(header=pb.MemoryHeader(length=read.size, found=True))
                pieces = read.pieces(PIECE_BYTES)
                while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
                    yield pb.MemoryPart(data=piece)
            finally:
                _close_soon(read)
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
        infos = await asyncio.to_thread(self._store.list, self._tenant(context))
        return pb.ListMemoriesResponse(memories=[memory_info_to_pb(i) for i in infos])

    @unary_rpc
    async def DeleteMemory(
        self, request: pb.DeleteMemoryRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteMemoryResponse:
        deleted = await asyncio.to_thread(
            self._store.delete, self._tenant(context), request.memory_id
        )
        return pb.DeleteMemoryResponse(deleted=deleted)


def _close_soon(read: MemoryRead) -> None:
    """Close ``read`` in a thread: a cancelled call may still have a piece being read, which
    ``close`` waits for (never on the event loop)."""
    try:
        asyncio.get_running_loop().run_in_executor(None, read.close)
    except RuntimeError:  # the loop's executor is shut down: nothing is reading any more
        read.close()


def add_memory_service(
    server: grpc.aio.Server, store: MemoryStore, metrics: Metrics, auth: Authenticator | None
) -> None:
    """Serve ``MemoryService`` on ``server`` (before it starts)."""
    pb_grpc.add_MemoryServiceServicer_to_server(MemoryServicer(store, metrics, auth), server)

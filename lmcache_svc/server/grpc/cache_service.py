"""The gRPC transport: a thin adapter from CacheService messages to ``TieredCache`` calls.

Runs on grpc.aio. Two thread pools keep arena work from queueing behind a slow lower tier:
calls that may block on a lower tier (promotion, a lookup that must ask Redis, deletes, inline
transfers) run on one, calls that only touch the arena (commit, abort, a load of chunks all in
the arena, a store that fits without eviction, session clean-up) on the other. A lookup
answered from the in-memory indices runs inline. Errors become a status code plus the error
kind in trailing metadata (``grpc/calls.py``); inline transfers (Put/Get) live in
``grpc/inline.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lmcache_svc import __version__
from lmcache_svc.cache import TieredCache
from lmcache_svc.errors import InvalidArgument, Unauthenticated, UnknownSession
from lmcache_svc.server.events.node_stream import NodeEvents
from lmcache_svc.server.grpc.auth import AuthInterceptor
from lmcache_svc.server.grpc.calls import abort_call, unary_rpc
from lmcache_svc.server.grpc.index_segments import index_segments, session_caller
from lmcache_svc.server.grpc.inline import InlineTransfers
from lmcache_svc.server.lookup_reports import ReportBudget, count_report
from lmcache_svc.server.open_sessions import OpenSessions
from lmcache_svc.server.stats import stats_fields
from lmcache_svc.server.status import grpc_code
from lmcache_svc.server.tokens import Authenticator, make_authenticator
from lmcache_svc.v1 import cache_pb2 as pb
from lmcache_svc.v1 import cache_pb2_grpc as pb_grpc
from lmcache_svc.wire import STORE_STATUS_CODES, channel_options, medium_to_pb, namespace_from_pb

T = TypeVar("T")

SERVICE_NAME = "lmcache_svc.v1.CacheService"

logger = logging.getLogger(__name__)


class CacheServicer(pb_grpc.CacheServiceServicer):
    def __init__(self, cache: TieredCache, *, max_body_bytes: int, workers: int) -> None:
        self._cache = cache
        self._metrics = cache.metrics
        # Calls that may wait on a lower tier (Redis, disk).
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lmcache-svc-grpc")
        self._inline = InlineTransfers(cache, max_body_bytes=max_body_bytes, pool=self._pool)
        # Calls that touch only the arena: never queued behind a hung lower tier.
        self._arena_pool = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="lmcache-svc-arena"
        )
        self.open_sessions = OpenSessions()
        self._report_budget = ReportBudget()
        # When no tier may block (no disk, no network: the CPU tier alone), prepare/commit/
        # delete only touch memory: running them on the event loop saves two thread
        # hand-offs per call (~0.1-0.2 ms of a 0.6 ms round trip here). Otherwise: pools.
        self._inline_slots = not any(t.may_block for t in cache.tiers)
        self._first = cache.tiers[0]

    async def _slots(self, fn: Callable[..., T], *args: Any, arena_only: bool, **kwargs: Any) -> T:
        """A slot operation: inline when it cannot block (no tier may), else on the arena
        pool when the caller knows it needs only the arena, else on the lower-tier pool."""
        if self._inline_slots:
            return fn(*args, **kwargs)
        pool = self._arena_pool if arena_only else self._pool
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, functools.partial(fn, *args, **kwargs))

    def _store_fits(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> bool:
        """Whether a store fits the arena below its high watermark, so it evicts (and
        demotes to a lower tier) nothing: a guess, and one that evicts after all is kept
        short by the lower tier's circuit breaker."""
        need = len(chunk_hashes) * self._cache.namespace(namespace_id).chunk_bytes
        room = self._cache.settings.high_watermark * self._first.capacity_bytes
        return self._first.used_bytes + need <= room

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def stop(self) -> None:
        """End the session streams; calls still draining keep their pools (``close``)."""
        self.open_sessions.end_all()

    def close(self) -> None:
        """After the gRPC server stopped: no call can arrive any more."""
        self._pool.shutdown(wait=False)
        self._arena_pool.shutdown(wait=False)

    @unary_rpc
    async def RegisterNamespace(
        self, request: pb.RegisterNamespaceRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterNamespaceResponse:
        ns = self._cache.register_namespace(namespace_from_pb(request.namespace))
        response = pb.RegisterNamespaceResponse(
            namespace_id=ns.namespace_id, chunk_bytes=ns.chunk_bytes
        )
        events = self._cache.listener
        if isinstance(events, NodeEvents) and (topic := events.topic_of(ns.namespace_id)):
            response.events_topic = topic
            response.events_endpoint = events.publisher.endpoint
            response.events_replay_endpoint = events.publisher.replay_endpoint or ""
        return response

    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionEvent]:
        try:
            session_id = self._cache.open_session()
            seg = self._cache.segment()
        except Exception as e:
            self._metrics.requests.labels(
                transport="grpc", method="OpenSession", code=grpc_code(e).name
            ).inc()
            await abort_call(context, e, self._metrics, "OpenSession")
            raise  # unreachable: abort raises
        self._metrics.requests.labels(transport="grpc", method="OpenSession", code="OK").inc()
        caller = session_caller()
        token_id = caller.token_id if caller is not None else None
        opened = self.open_sessions.add(token_id, session_id)
        try:
            yield pb.SessionEvent(
                session_id=session_id,
                segments=[
                    pb.Segment(
                        transport=seg.transport, name=seg.name, size=seg.size, nonce=seg.nonce
                    ),
                    *index_segments(self._cache),
                ],
            )
            await opened.ended.wait()
            if opened.revoked:
                revoked = Unauthenticated(
                    "the token of this session was revoked (tokens file reloaded): the "
                    "session ended and what it held was given back"
                )
                await abort_call(context, revoked, self._metrics, "OpenSession")
        finally:
            # The client went away, the server stops or the token was revoked: reclaim
            # what the session held.
            self.open_sessions.remove(token_id, session_id)
            # Shielded: when the server stops, gRPC cancels this stream again while the
            # slots are being given back; the cleanup still runs to its end in its own task.
            cleanup = asyncio.ensure_future(
                self._slots(self._cache.close_session, session_id, arena_only=True)
            )
            cleanup.add_done_callback(_log_failed_cleanup)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(cleanup)

    @unary_rpc
    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupResponse:
        # The in-memory indices first (inline); only a lookup that must ask a shared tier
        # (Redis) goes to the lower-tier pool.
        result = self._cache.lookup_local(request.namespace_id, request.chunk_hashes)
        if result is None:
            result = await self._run(self._cache.lookup, request.namespace_id, request.chunk_hashes)
        return pb.LookupResponse(
            num_hit_chunks=result.num_hit_chunks,
            tiers=result.tiers,
            media=[medium_to_pb(m) for m in result.media],
        )

    @unary_rpc
    async def ReportLookups(
        self, request: pb.ReportLookupsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportLookupsResponse:
        count_report(self._cache, request, self._report_budget)
        return pb.ReportLookupsResponse()

    def _check_session(self, session_id: str) -> None:
        if session_id and not self._cache.has_session(session_id):
            raise UnknownSession(
                f"session {session_id!r} is unknown (did the server restart?); open a new session"
            )

    @staticmethod
    def _require_session(session_id: str, method: str) -> None:
        """Shared-memory stores belong to a session: an empty id would let any caller commit
        or abort every other session-less reservation."""
        if not session_id:
            raise InvalidArgument(
                f"{method} needs the session_id of a session opened with OpenSession "
                "(its reservations belong to it); without shared memory, use Put"
            )

    @unary_rpc
    async def PrepareStore(
        self, request: pb.PrepareStoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrepareStoreResponse:
        self._require_session(request.session_id, "PrepareStore")
        self._check_session(request.session_id)
        prepared = await self._slots(
            self._cache.prepare_store,
            request.namespace_id,
            request.chunk_hashes,
            arena_only=self._store_fits(request.namespace_id, request.chunk_hashes),
            session_id=request.session_id,
            ttl_s=request.ttl_ms / 1000,
        )
        slots = [
            pb.PreparedSlot(
                chunk_hash=p.chunk_hash,
                status=STORE_STATUS_CODES[p.status],
                offset=p.slot.offset if p.slot else 0,
                length=p.slot.length if p.slot else 0,
            )
            for p in prepared
        ]
        return pb.PrepareStoreResponse(slots=slots, segment_name=self._cache.segment().name)

    @unary_rpc
    async def CommitStore(
        self, request: pb.CommitStoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitStoreResponse:
        self._require_session(request.session_id, "CommitStore")
        if request.reserved_as:
            if request.abort:
                raise InvalidArgument("abort pooled slots by their reserved_as hashes alone")
            num, kept = await self._slots(
                self._cache.bind_store,
                request.namespace_id,
                request.chunk_hashes,
                request.reserved_as,
                arena_only=True,
                session_id=request.session_id,
                token_ids=request.token_ids,
                parent_hashes=request.parent_hashes,
            )
            return pb.CommitStoreResponse(num_committed=num, kept=kept)
        if request.abort:
            num = await self._slots(
                self._cache.abort_store,
                request.namespace_id,
                request.chunk_hashes,
                arena_only=True,
                session_id=request.session_id,
            )
            return pb.CommitStoreResponse(num_committed=num)
        num = await self._slots(
            self._cache.commit_store,
            request.namespace_id,
            request.chunk_hashes,
            arena_only=True,
            session_id=request.session_id,
            token_ids=request.token_ids,
            parent_hashes=request.parent_hashes,
        )
        return pb.CommitStoreResponse(num_committed=num)

    @unary_rpc
    async def PrepareLoad(
        self, request: pb.PrepareLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrepareLoadResponse:
        self._check_session(request.session_id)
        args = (self._cache.prepare_load, request.namespace_id, request.chunk_hashes)
        kwargs: dict[str, Any] = {
            "session_id": request.session_id or None,
            "ttl_s": request.ttl_ms / 1000,
            "verify": request.verify,
        }
        if request.verify:  # hashes every leased chunk: bulk work, never on the event loop
            lease = await self._run(*args, **kwargs)
        else:
            in_arena = self._cache.first_tier_holds(request.namespace_id, request.chunk_hashes)
            lease = await self._slots(*args, arena_only=in_arena, **kwargs)
        slots = [
            pb.SlotRef(chunk_hash=h, offset=s.offset, length=s.length)
            for h, s in zip(request.chunk_hashes, lease.slots)
        ]
        return pb.PrepareLoadResponse(
            lease_id=lease.lease_id or "", slots=slots, segment_name=self._cache.segment().name
        )

    @unary_rpc
    async def ReleaseLoad(
        self, request: pb.ReleaseLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseLoadResponse:
        return pb.ReleaseLoadResponse(released=self._cache.release_load(request.lease_id))

    @unary_rpc
    async def TouchChunks(
        self, request: pb.TouchChunksRequest, context: grpc.aio.ServicerContext
    ) -> pb.TouchChunksResponse:
        num = await self._slots(
            self._cache.touch, request.namespace_id, request.chunk_hashes, arena_only=True
        )
        return pb.TouchChunksResponse(num_touched=num)

    @unary_rpc
    async def Put(
        self, request_iterator: AsyncIterator[pb.ChunkPart], context: grpc.aio.ServicerContext
    ) -> pb.PutResponse:
        return await self._inline.put(request_iterator)

    async def Get(
        self, request: pb.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ChunkPart]:
        async for part in self._inline.get(request, context):
            yield part

    @unary_rpc
    async def Delete(
        self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteResponse:
        num = await self._slots(
            self._cache.delete, request.namespace_id, request.chunk_hashes, arena_only=False
        )
        return pb.DeleteResponse(num_deleted=num)

    @unary_rpc
    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        return pb.StatsResponse(**stats_fields(self._cache), version=__version__)


def build_grpc_server(
    cache: TieredCache,
    *,
    max_body_bytes: int,
    workers: int,
    auth_token: str | None = None,
    auth: Authenticator | None = None,
) -> tuple[grpc.aio.Server, CacheServicer, health.aio.HealthServicer]:
    """``auth`` (or, without it, ``auth_token`` as an admin token) turns authentication on."""
    auth = auth or make_authenticator(auth_token)
    interceptors = [AuthInterceptor(auth, cache)] if auth is not None else []
    server = grpc.aio.server(interceptors=interceptors, options=channel_options())
    servicer = CacheServicer(cache, max_body_bytes=max_body_bytes, workers=workers)
    if auth is not None:  # a revoked token's sessions end
        auth.on_revoke(servicer.open_sessions.revoke)
    pb_grpc.add_CacheServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, servicer, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, status)


def _log_failed_cleanup(task: asyncio.Future[Any]) -> None:
    """A session's cleanup that failed: logged (nobody awaits it once the server stops)."""
    if not task.cancelled() and (error := task.exception()) is not None:
        logger.error("giving back a closed session's slots failed", exc_info=error)

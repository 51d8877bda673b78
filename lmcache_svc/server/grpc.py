"""The gRPC transport: a thin adapter from CacheService messages to ``TieredCache`` calls.

Runs on grpc.aio. Two thread pools keep arena work from queueing behind a slow lower tier:
calls that may block on a lower tier (promotion, a lookup that must ask Redis, deletes, inline
transfers) run on one, calls that only touch the arena (commit, abort, a load of chunks all in
the arena, a store that fits without eviction, session clean-up) on the other. A lookup
answered from the in-memory indices runs inline. Errors become a status code
(``server/status.py``) plus the error kind in trailing metadata (``wire.ERROR_KIND_KEY``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lmcache_svc import __version__
from lmcache_svc.cache import TieredCache
from lmcache_svc.errors import (
    InvalidArgument,
    LMCacheSvcError,
    PayloadTooLarge,
    ReservationExpired,
    SizeMismatch,
    UnknownSession,
)
from lmcache_svc.keys import check_chunk_hash
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.grpc_auth import AuthInterceptor
from lmcache_svc.server.grpc_index import index_segments
from lmcache_svc.server.stats import stats_fields
from lmcache_svc.server.status import INTERNAL_KIND, grpc_code
from lmcache_svc.server.tokens import Authenticator, make_authenticator
from lmcache_svc.v1 import cache_pb2 as pb
from lmcache_svc.v1 import cache_pb2_grpc as pb_grpc
from lmcache_svc.wire import (
    ERROR_KIND_KEY,
    PIECE_BYTES,
    STORE_STATUS_CODES,
    channel_options,
    medium_to_pb,
    namespace_from_pb,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

SERVICE_NAME = "lmcache_svc.v1.CacheService"


async def _abort(
    context: grpc.aio.ServicerContext, error: Exception, metrics: Metrics, method: str
) -> None:
    """End the call with the status that reports ``error`` (counted in the errors metric).

    A project error sends its message and kind. Anything else is a bug: ``INTERNAL`` with a
    generic message, the traceback only in the server's log (never ``UNKNOWN`` with the
    exception's text, which may show internals to the client).
    """
    if isinstance(error, LMCacheSvcError):
        kind, message = error.kind, str(error)
    else:
        log.error("gRPC %s failed unexpectedly", method, exc_info=error)
        kind, message = INTERNAL_KIND, f"internal error in {method}; the server log has details"
    metrics.errors.labels(kind=kind).inc()
    context.set_trailing_metadata(((ERROR_KIND_KEY, kind),))
    await context.abort(grpc_code(error), message)


class _Servicer(Protocol):
    _metrics: Metrics


S = TypeVar("S", bound=_Servicer)
R = TypeVar("R")  # a request message, or a stream of them
Handler = Callable[[S, R, grpc.aio.ServicerContext], Awaitable[T]]


def _rpc(method: Handler[S, R, T]) -> Handler[S, R, T]:
    """Count and time a unary call; turn errors into status codes (``_abort``)."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: S, request: R, context: grpc.aio.ServicerContext) -> T:
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise  # the method ended the call itself
        except Exception as e:
            code = grpc_code(e)
            await _abort(context, e, self._metrics, name)
            raise  # unreachable: abort raises
        finally:
            self._metrics.requests.labels(transport="grpc", method=name, code=code.name).inc()
            self._metrics.request_latency.labels(transport="grpc", method=name).observe(
                time.perf_counter() - start
            )

    return wrapper


class CacheServicer(pb_grpc.CacheServiceServicer):
    def __init__(self, cache: TieredCache, *, max_body_bytes: int, workers: int) -> None:
        self._cache = cache
        self._metrics = cache.metrics
        self._max_body_bytes = max_body_bytes
        # Calls that may wait on a lower tier (Redis, disk).
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lmcache-svc-grpc")
        # Calls that touch only the arena: never queued behind a hung lower tier.
        self._arena_pool = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="lmcache-svc-arena"
        )
        self._stopping = asyncio.Event()
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
        self._stopping.set()

    def close(self) -> None:
        """After the gRPC server stopped: no call can arrive any more."""
        self._pool.shutdown(wait=False)
        self._arena_pool.shutdown(wait=False)

    @_rpc
    async def RegisterNamespace(
        self, request: pb.RegisterNamespaceRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterNamespaceResponse:
        ns = self._cache.register_namespace(namespace_from_pb(request.namespace))
        return pb.RegisterNamespaceResponse(
            namespace_id=ns.namespace_id, chunk_bytes=ns.chunk_bytes
        )

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
            await _abort(context, e, self._metrics, "OpenSession")
            raise  # unreachable: abort raises
        self._metrics.requests.labels(transport="grpc", method="OpenSession", code="OK").inc()
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
            await self._stopping.wait()
        finally:
            # The client went away (or the server stops): reclaim what it held.
            await self._slots(self._cache.close_session, session_id, arena_only=True)

    @_rpc
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

    @_rpc
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

    @_rpc
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
            )
            return pb.CommitStoreResponse(num_committed=num, kept=kept)
        fn = self._cache.abort_store if request.abort else self._cache.commit_store
        num = await self._slots(
            fn,
            request.namespace_id,
            request.chunk_hashes,
            arena_only=True,
            session_id=request.session_id,
        )
        return pb.CommitStoreResponse(num_committed=num)

    @_rpc
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

    @_rpc
    async def ReleaseLoad(
        self, request: pb.ReleaseLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseLoadResponse:
        return pb.ReleaseLoadResponse(released=self._cache.release_load(request.lease_id))

    @_rpc
    async def Put(
        self, request_iterator: AsyncIterator[pb.ChunkPart], context: grpc.aio.ServicerContext
    ) -> pb.PutResponse:
        counts = _PutCounts()
        upload: _Upload | None = None
        parts = aiter(request_iterator)
        try:
            while (part := await _next_part(parts, upload)) is not None:
                if part.HasField("header"):
                    if upload is not None:
                        upload.finish(counts)
                    upload = await self._run(self._begin_upload, part.header)
                elif upload is None:
                    raise InvalidArgument("Put stream sent data before a chunk header")
                else:
                    upload.write(part.data)
            if upload is not None:
                upload.finish(counts)
                upload = None
        finally:
            if upload is not None:
                upload.abort()
        return pb.PutResponse(
            num_stored=counts.stored,
            num_no_space=counts.no_space,
            num_in_progress=counts.in_progress,
        )

    def _begin_upload(self, header: pb.ChunkHeader) -> _Upload:
        ns = self._cache.namespace(header.namespace_id)
        if header.length > self._max_body_bytes:
            raise PayloadTooLarge(
                f"chunk of {header.length} bytes is over max_body_bytes ({self._max_body_bytes})"
            )
        if header.length != ns.chunk_bytes:
            raise SizeMismatch(
                f"chunk header says {header.length} bytes; namespace {ns.namespace_id.hex()} "
                f"stores chunks of exactly {ns.chunk_bytes} bytes"
            )
        return _Upload(self._cache, header.namespace_id, check_chunk_hash(header.chunk_hash))

    async def Get(
        self, request: pb.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ChunkPart]:
        start = time.perf_counter()
        code = "OK"
        try:
            self._cache.check_batch(request.namespace_id, len(request.chunk_hashes))
            keys = [check_chunk_hash(h) for h in request.chunk_hashes]
            for h in keys:
                found = await self._run(
                    self._cache.get, request.namespace_id, h, verify=request.verify
                )
                if found is None:
                    yield pb.ChunkPart(
                        header=pb.ChunkHeader(
                            namespace_id=request.namespace_id, chunk_hash=h, found=False
                        )
                    )
                    continue
                data, tier = found
                yield pb.ChunkPart(
                    header=pb.ChunkHeader(
                        namespace_id=request.namespace_id,
                        chunk_hash=h,
                        length=len(data),
                        found=True,
                        tier=tier,
                    )
                )
                for i in range(0, len(data), PIECE_BYTES):
                    yield pb.ChunkPart(data=data[i : i + PIECE_BYTES])
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            code = grpc_code(e).name
            await _abort(context, e, self._metrics, "Get")
        finally:
            self._metrics.requests.labels(transport="grpc", method="Get", code=code).inc()
            self._metrics.request_latency.labels(transport="grpc", method="Get").observe(
                time.perf_counter() - start
            )

    @_rpc
    async def Delete(
        self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteResponse:
        num = await self._slots(
            self._cache.delete, request.namespace_id, request.chunk_hashes, arena_only=False
        )
        return pb.DeleteResponse(num_deleted=num)

    @_rpc
    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        return pb.StatsResponse(**stats_fields(self._cache), version=__version__)


async def _next_part(
    parts: AsyncIterator[pb.ChunkPart], upload: _Upload | None
) -> pb.ChunkPart | None:
    """The stream's next part (None at its end); a client that stalls while an upload holds
    a reservation gets ``ReservationExpired`` when the reservation runs out."""
    timeout = upload.seconds_left() if upload is not None else None
    try:
        return await asyncio.wait_for(anext(parts, None), timeout)
    except TimeoutError:
        assert upload is not None
        raise upload.expired_error("the client sent nothing more before it ran out") from None


@dataclasses.dataclass(slots=True)
class _PutCounts:
    stored: int = 0
    no_space: int = 0
    in_progress: int = 0


class _Upload:
    """One inline chunk being written straight into a reserved slot.

    The reservation is the upload's own (owner ``put-<random>``). Before each write it
    checks the reservation is still its own and extends it (data arriving is progress), up to
    ``max_reservation_ttl_s`` in all; once it has expired, writes and the commit fail with
    ``ReservationExpired`` and nothing is stored. An expired reservation's slot is
    quarantined by the cache, not reused, until this upload commits or aborts it, so a
    write racing with the expiry can only land in a slot no other chunk has.
    """

    def __init__(self, cache: TieredCache, namespace_id: bytes, chunk_hash: bytes) -> None:
        self._cache, self._ns_id, self._hash = cache, namespace_id, chunk_hash
        self._owner = f"put-{secrets.token_hex(8)}"
        self._ttl_s = cache.settings.reservation_ttl_s
        now = time.monotonic()
        self._last_deadline = now + cache.settings.max_reservation_ttl_s
        (prepared,) = cache.prepare_store(namespace_id, [chunk_hash], session_id=self._owner)
        self._deadline = now + self._ttl_s
        self.status = prepared.status
        self._view = cache.view(prepared.slot) if prepared.slot is not None else None
        self._size = cache.namespace(namespace_id).chunk_bytes
        self._written = 0

    def seconds_left(self) -> float | None:
        """Until the reservation expires (None: the upload holds none)."""
        if self._view is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def expired_error(self, why: str) -> ReservationExpired:
        return ReservationExpired(
            f"chunk {self._hash.hex()} was not stored: its reservation expired after "
            f"{self._written} of {self._size} bytes ({why})"
        )

    def write(self, data: bytes) -> None:
        end = self._written + len(data)
        if end > self._size:
            raise SizeMismatch(f"chunk data runs past its header's {self._size} bytes")
        if self._view is not None:
            deadline = min(time.monotonic() + self._ttl_s, self._last_deadline)
            if not self._cache.renew_store(self._ns_id, self._hash, self._owner, deadline):
                raise self.expired_error("the data came too slowly")
            self._deadline = max(self._deadline, deadline)
            self._view[self._written : end] = data
        self._written = end

    def finish(self, counts: _PutCounts) -> None:
        if self._written != self._size:
            raise SizeMismatch(
                f"chunk {self._hash.hex()} got {self._written} of its {self._size} bytes"
            )
        if self._view is not None:
            self._view = None
            if not self._cache.commit_store(self._ns_id, [self._hash], session_id=self._owner):
                raise self.expired_error("it was complete only after its deadline")
        if self.status == "no_space":
            counts.no_space += 1
        elif self.status == "in_progress":
            counts.in_progress += 1
        else:
            counts.stored += 1

    def abort(self) -> None:
        if self._view is not None:
            self._view = None
            self._cache.abort_store(self._ns_id, [self._hash], session_id=self._owner)


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

"""Inline transfers for clients without the shared segment: ``Put`` and ``Get`` stream a
chunk's bytes through gRPC (a header, then pieces of at most ``wire.PIECE_BYTES``).

``Put`` writes each chunk straight into a slot reserved for the upload (``_Upload``); ``Get``
reads chunk by chunk on the lower-tier pool. ``CacheServicer`` delegates both here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import secrets
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from lmcache_svc.cache import TieredCache
from lmcache_svc.errors import InvalidArgument, PayloadTooLarge, ReservationExpired, SizeMismatch
from lmcache_svc.keys import check_chunk_hash
from lmcache_svc.server.grpc.calls import abort_call, count_call
from lmcache_svc.server.status import grpc_code
from lmcache_svc.v1 import cache_pb2 as pb
from lmcache_svc.wire import PIECE_BYTES

T = TypeVar("T")


class InlineTransfers:
    """The bodies of ``Put`` and ``Get``; blocking cache calls run on ``pool``."""

    def __init__(
        self, cache: TieredCache, *, max_body_bytes: int, pool: ThreadPoolExecutor
    ) -> None:
        self._cache = cache
        self._metrics = cache.metrics
        self._max_body_bytes = max_body_bytes
        self._pool = pool

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def put(self, request_iterator: AsyncIterator[pb.ChunkPart]) -> pb.PutResponse:
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
        _check_description(header, ns.chunk_size)
        return _Upload(
            self._cache, header.namespace_id, check_chunk_hash(header.chunk_hash),
            token_ids=header.token_ids, parent_hash=header.parent_hash,
        )  # fmt: skip

    async def get(
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
            await abort_call(context, e, self._metrics, "Get")
        finally:
            count_call(self._metrics, "Get", code, start)


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

    ``token_ids`` and ``parent_hash`` (the header's, optional) describe the chunk for the KV
    events and go with the commit, which checks them against the chunk hash.
    """

    def __init__(
        self,
        cache: TieredCache,
        namespace_id: bytes,
        chunk_hash: bytes,
        *,
        token_ids: bytes = b"",
        parent_hash: bytes = b"",
    ) -> None:
        self._cache, self._ns_id, self._hash = cache, namespace_id, chunk_hash
        self._token_ids, self._parent_hash = token_ids, parent_hash
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
            # tokens that do not hash to the chunk raise here; the caller then aborts
            committed = self._cache.commit_store(
                self._ns_id, [self._hash], session_id=self._owner, token_ids=self._token_ids,
                parent_hashes=[self._parent_hash] if self._token_ids else (),
            )  # fmt: skip
            self._view = None
            if not committed:
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


def _check_description(header: pb.ChunkHeader, chunk_size: int) -> None:
    """The tokens' shape, before a slot is reserved and the bytes streamed (whether they
    hash to the chunk is checked at the commit, where events are on)."""
    if header.token_ids and len(header.token_ids) != 4 * chunk_size:
        raise InvalidArgument(
            f"chunk header's token_ids holds {len(header.token_ids)} bytes; a chunk of "
            f"{chunk_size} tokens takes {4 * chunk_size} (little-endian uint32)"
        )
    if header.parent_hash and not header.token_ids:
        raise InvalidArgument("chunk header has a parent_hash without token_ids")
    if header.parent_hash and len(header.parent_hash) != 32:
        raise InvalidArgument(
            f"chunk header's parent_hash is {len(header.parent_hash)} bytes, not 32"
        )

"""The blocking Python client of the cache server: ``CacheClient``.

It speaks gRPC over a Unix socket (``/path/x.sock`` or ``unix:/path/x.sock``) or TCP
(``host:port``). On the same host it maps the server's shared segment and moves bulk bytes
in place: ``prepare_store`` hands out writable views of reserved slots, ``prepare_load``
views of leased slots; only offsets cross gRPC. Elsewhere ``store``/``load`` fall back to
inline streams (``Put``/``Get``). ``AsyncCacheClient`` (``aio_client.py``) is the asyncio
counterpart for inline transfers.

Faults: every call has a deadline; an unreachable or slow server raises ``ServerUnavailable``.
gRPC channels reconnect by themselves; after a server restart the client re-registers its
namespaces and opens a new session on the next call that needs one. Needs only grpcio,
protobuf and numpy (no server extras).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import grpc

from lmcache_svc import errors
from lmcache_svc.aio_client import AsyncCacheClient
from lmcache_svc.arena import ArenaMapping
from lmcache_svc.keys import Namespace, NamespaceId
from lmcache_svc.memories.format import MemoryInfo
from lmcache_svc.rpc import (
    GetAssembler,
    LoadLease,
    LookupResult,
    StoreSlot,
    auth_metadata,
    check_mapping,
    client_channel_options,
    convert_rpc_error,
    default_address,
    grpc_target,
    join_memory_parts,
    load_lease,
    map_segment,
    memory_parts,
    memory_timeout,
    put_parts,
    stats_dict,
    store_slots,
)
from lmcache_svc.shm_index import answer_locally, open_index_segments
from lmcache_svc.v1 import cache_pb2 as pb
from lmcache_svc.v1 import cache_pb2_grpc as pb_grpc
from lmcache_svc.wire import memory_info_from_pb, namespace_to_pb

__all__ = [
    "AsyncCacheClient",
    "CacheClient",
    "LoadLease",
    "LookupResult",
    "MemoryInfo",
    "StoreSlot",
    "default_address",
]


class _Session:
    """An open session stream and the mapped segment; dead once the stream ends."""

    def __init__(self, stream: Any, event: pb.SessionEvent) -> None:
        self.session_id = event.session_id
        self.mapping, self.segment_name = map_segment(event)
        self.indexes = open_index_segments(event.segments)  # lookups without a round trip
        self._stream = stream
        self.alive = True
        threading.Thread(target=self._watch, name="lmcache-svc-session", daemon=True).start()

    def _watch(self) -> None:
        try:
            for _ in self._stream:
                pass
        except grpc.RpcError:
            pass
        self.alive = False

    def close(self) -> None:
        self.alive = False
        self._stream.cancel()


class CacheClient:
    """Blocking client; thread-safe. Use as a context manager or call ``close()``."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 5.0,
        client_name: str = "",
        use_shm: bool = True,
        auth_token: str | None = None,
        local_lookup: bool = False,
    ) -> None:
        """``local_lookup``: answer ``lookup`` from the server's shared-memory index when the
        session (opened by any shared-memory call, or ``shm_available``) mapped it here; the
        server's lookup metrics then count only the lookups that reach it."""
        self._target = grpc_target(address)
        self.timeout_s = timeout_s
        self._client_name = client_name
        self._use_shm = use_shm
        self._local_lookup = local_lookup
        self._metadata = auth_metadata(auth_token)
        self._channel = grpc.insecure_channel(self._target, options=client_channel_options())
        self._stub = pb_grpc.CacheServiceStub(self._channel)
        self._memories = pb_grpc.MemoryServiceStub(self._channel)
        self._namespaces: dict[bytes, Namespace] = {}
        self._session: _Session | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._session is not None:
                self._session.close()
                self._session = None
        self._channel.close()

    # -- plumbing ------------------------------------------------------------------------

    def _call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return getattr(self._stub, method)(
                request, timeout=timeout_s or self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise convert_rpc_error(e) from None

    def _ns_call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        """A call on a namespace; re-registers it once if the server forgot it (restart)."""
        try:
            return self._call(method, request, timeout_s)
        except errors.UnknownNamespace:
            ns = self._namespaces.get(bytes(request.namespace_id))
            if ns is None:
                raise
            self.register_namespace(ns)
            return self._call(method, request, timeout_s)

    def _session_call(self, method: str, make_request: Any) -> tuple[_Session, Any]:
        """A call that needs a live session; opens a new one once if the old one is gone."""
        for attempt in (0, 1):
            session = self._live_session()
            try:
                return session, self._ns_call(method, make_request(session.session_id))
            except errors.UnknownSession:
                with self._lock:
                    if self._session is session:
                        self._session = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _live_session(self) -> _Session:
        with self._lock:
            if self._session is not None and self._session.alive:
                return self._session
            stream = self._stub.OpenSession(
                pb.OpenSessionRequest(client_name=self._client_name), metadata=self._metadata
            )
            try:
                event = _first_event(stream, self.timeout_s)
            except grpc.RpcError as e:
                stream.cancel()
                raise convert_rpc_error(e) from None
            self._session = _Session(stream, event)
            return self._session

    @property
    def shm_available(self) -> bool:
        """True when the server's segment is mapped here (same host); opens a session."""
        if not self._use_shm:
            return False
        try:
            return self._live_session().mapping is not None
        except errors.ServerUnavailable:
            return False

    def wait_shm_ready(self, timeout_s: float = 60.0) -> bool:
        """Open the session and wait until the segment is mapped and pre-faulted here
        (benchmarks time copies only once the mapping is warm); False without shm."""
        if not self.shm_available:
            return False
        mapping = self._live_session().mapping
        return mapping is not None and mapping.prefault_done.wait(timeout_s)

    # -- namespaces and lookup -----------------------------------------------------------

    def register_namespace(self, namespace: Namespace) -> NamespaceId:
        resp = self._call(
            "RegisterNamespace", pb.RegisterNamespaceRequest(namespace=namespace_to_pb(namespace))
        )
        self._namespaces[bytes(resp.namespace_id)] = namespace
        return NamespaceId(bytes(resp.namespace_id))

    def lookup(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], *, timeout_s: float | None = None
    ) -> LookupResult:
        session = self._session
        ns = self._namespaces.get(bytes(namespace_id))
        if self._local_lookup and session is not None and session.alive and ns is not None:
            local = answer_locally(session.indexes, ns.tenant, chunk_hashes)
            if local is not None:
                return LookupResult(local[0], [local[1]] * local[0])
        resp = self._ns_call(
            "Lookup",
            pb.LookupRequest(namespace_id=namespace_id, chunk_hashes=chunk_hashes),
            timeout_s,
        )
        return LookupResult(resp.num_hit_chunks, list(resp.tiers))

    # -- shared-memory path --------------------------------------------------------------

    def prepare_store(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> list[StoreSlot]:
        """Reserve slots; write each 'reserved' buffer, then ``commit_store`` those hashes."""
        session, resp = self._session_call(
            "PrepareStore",
            lambda sid: pb.PrepareStoreRequest(
                namespace_id=namespace_id, chunk_hashes=chunk_hashes, session_id=sid
            ),
        )
        return store_slots(resp, self._mapping_for(session, resp.segment_name))

    def commit_store(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], *, abort: bool = False
    ) -> int:
        session = self._live_session()
        resp = self._ns_call(
            "CommitStore",
            pb.CommitStoreRequest(
                namespace_id=namespace_id,
                chunk_hashes=chunk_hashes,
                session_id=session.session_id,
                abort=abort,
            ),
        )
        return int(resp.num_committed)

    def prepare_load(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], *, verify: bool = False
    ) -> LoadLease:
        """Lease the longest available prefix; read the (read-only) buffers, then
        ``release_load``. ``verify``: the server first checks each chunk against its checksum
        and leases only the intact prefix."""
        session, resp = self._session_call(
            "PrepareLoad",
            lambda sid: pb.PrepareLoadRequest(
                namespace_id=namespace_id, chunk_hashes=chunk_hashes, session_id=sid, verify=verify
            ),
        )
        if not resp.lease_id:
            return LoadLease(None)
        return load_lease(resp, self._mapping_for(session, resp.segment_name))

    def release_load(self, lease: LoadLease) -> bool:
        if lease.lease_id is None:
            return False
        return bool(
            self._call("ReleaseLoad", pb.ReleaseLoadRequest(lease_id=lease.lease_id)).released
        )

    def _mapping_for(self, session: _Session, segment_name: str) -> ArenaMapping:
        try:
            return check_mapping(session.mapping, session.segment_name, segment_name)
        except errors.ServerUnavailable:
            with self._lock:
                self._session = None
            raise

    # -- convenience and inline transfers ------------------------------------------------

    def store(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], buffers: Sequence[Any]
    ) -> int:
        """Store chunks (shared memory when available, else inline); returns chunks now stored."""
        if not self.shm_available:
            return self.put(namespace_id, list(zip(chunk_hashes, buffers)))
        slots = self.prepare_store(namespace_id, chunk_hashes)
        reserved = [s.chunk_hash for s in slots if s.status == "reserved"]
        try:
            for slot, data in zip(slots, buffers):
                if slot.buffer is not None:
                    slot.buffer[:] = memoryview(data).cast("B")
        except BaseException:
            self.commit_store(namespace_id, reserved, abort=True)
            raise
        committed = self.commit_store(namespace_id, reserved)
        return committed + sum(s.status == "already_stored" for s in slots)

    def load(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], *, verify: bool = False
    ) -> list[bytes]:
        """Bytes of the longest available prefix (shared memory when available, else inline);
        ``verify``: only chunks that match their checksums."""
        if not self.shm_available:
            out: list[bytes] = []
            for data in self.get(namespace_id, chunk_hashes, verify=verify):
                if data is None:
                    break
                out.append(data)
            return out
        lease = self.prepare_load(namespace_id, chunk_hashes, verify=verify)
        try:
            return [bytes(b) for b in lease.buffers]
        finally:
            self.release_load(lease)

    def put(self, namespace_id: bytes, items: Sequence[tuple[bytes, Any]]) -> int:
        """Inline store (streamed); returns the chunks stored (or already stored)."""
        try:
            resp = self._stub.Put(
                put_parts(namespace_id, items),
                timeout=self._bulk_timeout(items),
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            raise convert_rpc_error(e) from None
        return int(resp.num_stored)

    def get(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], *, verify: bool = False
    ) -> list[bytes | None]:
        """Inline load (streamed); None for each chunk not found."""
        assembler = GetAssembler()
        try:
            for part in self._stub.Get(
                pb.GetRequest(namespace_id=namespace_id, chunk_hashes=chunk_hashes, verify=verify),
                timeout=self.timeout_s * max(1, len(chunk_hashes)),
                metadata=self._metadata,
            ):
                assembler.feed(part)
        except grpc.RpcError as e:
            raise convert_rpc_error(e) from None
        return assembler.result()

    def _bulk_timeout(self, items: Sequence[Any]) -> float:
        return self.timeout_s * max(1, len(items))

    def delete(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> int:
        resp = self._ns_call(
            "Delete", pb.DeleteRequest(namespace_id=namespace_id, chunk_hashes=chunk_hashes)
        )
        return int(resp.num_deleted)

    def stats(self) -> dict[str, Any]:
        return stats_dict(self._call("Stats", pb.StatsRequest()))

    # -- named memories (docs/memories.md) -------------------------------------------------

    def put_memory(self, blob: bytes | bytearray | memoryview) -> MemoryInfo:
        """Store a memory blob (safetensors with its metadata); storing the same bytes again
        is a no-op. Raises ``BadMemory``, ``Conflict`` (the id holds other bytes),
        ``PayloadTooLarge`` or ``NoSpace``."""
        size = memoryview(blob).nbytes
        try:
            resp = self._memories.PutMemory(
                memory_parts(blob),
                timeout=memory_timeout(self.timeout_s, size),
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            raise convert_rpc_error(e) from None
        return memory_info_from_pb(resp.memory)

    def get_memory(self, memory_id: str) -> bytes | None:
        """The memory's blob, or None when this tenant has no such memory."""
        request = pb.GetMemoryRequest(memory_id=memory_id)
        try:
            parts = self._memories.GetMemory(
                request, timeout=memory_timeout(self.timeout_s, 1 << 30), metadata=self._metadata
            )
            return join_memory_parts(parts)
        except grpc.RpcError as e:
            raise convert_rpc_error(e) from None

    def list_memories(self) -> list[MemoryInfo]:
        """This tenant's memories, ordered by id."""
        resp = self._memory_call("ListMemories", pb.ListMemoriesRequest())
        return [memory_info_from_pb(m) for m in resp.memories]

    def delete_memory(self, memory_id: str) -> bool:
        """Delete a memory; False when there was none."""
        resp = self._memory_call("DeleteMemory", pb.DeleteMemoryRequest(memory_id=memory_id))
        return bool(resp.deleted)

    def _memory_call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._memories, method)(
                request, timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise convert_rpc_error(e) from None

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until the server answers (raises ServerUnavailable after ``timeout_s``)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise errors.ServerUnavailable(
                f"no lmcache-svc server answered at {self._target} within {timeout_s} s"
            ) from None


def _first_event(stream: Any, timeout_s: float) -> pb.SessionEvent:
    """The session's first event, or ServerUnavailable if it does not come in time."""
    result: list[Any] = []
    done = threading.Event()

    def read() -> None:
        try:
            result.append(next(stream))
        except BaseException as e:  # handed to the caller below
            result.append(e)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(timeout_s):
        stream.cancel()
        raise errors.ServerUnavailable(f"no session from the server within {timeout_s} s")
    if isinstance(result[0], grpc.RpcError):
        raise result[0]
    if isinstance(result[0], BaseException):
        raise errors.ServerUnavailable(f"session stream ended: {result[0]!r}")
    return result[0]

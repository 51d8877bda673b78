"""The blocking Python client of the cache server: ``CacheClient``.

It speaks gRPC over a Unix socket (``/path/x.sock`` or ``unix:/path/x.sock``) or TCP
(``host:port``). On the same host it maps the server's shared segment and moves bulk bytes
in place: ``prepare_store`` hands out writable views of reserved slots, ``prepare_load``
views of leased slots; only offsets cross gRPC. Elsewhere (another host, or ``use_shm=False``)
``store``/``load`` fall back to inline streams (``Put``/``Get``). There is no asyncio client:
the plugin and the tools call this one from threads.

Faults: every call has a deadline; an unreachable or slow server raises ``ServerUnavailable``.
gRPC channels reconnect by themselves; after a server restart the client re-registers its
namespaces and opens a new session on the next call that needs one. Needs only grpcio,
protobuf and numpy (no server extras).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from lmcache_svc import errors
from lmcache_svc.arena import ArenaMapping
from lmcache_svc.client.transport import (
    GetAssembler,
    LoadLease,
    NsReq,
    Req,
    Resp,
    StoreSlot,
    UnaryCall,
    auth_metadata,
    check_mapping,
    client_channel_options,
    convert_rpc_error,
    first_event,
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
from lmcache_svc.keys import Namespace, NamespaceId
from lmcache_svc.memories.format import MemoryInfo
from lmcache_svc.results import LookupResult
from lmcache_svc.shm_index import answer_locally, open_index_segments
from lmcache_svc.v1 import cache_pb2 as pb
from lmcache_svc.v1 import cache_pb2_grpc as pb_grpc
from lmcache_svc.wire import medium_from_pb, memory_info_from_pb, namespace_to_pb


class _Session:
    """An open session stream and the mapped segment; dead once the stream ends."""

    def __init__(self, stream: Any, event: pb.SessionEvent) -> None:  # a grpc stream call
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

    def _call(
        self, rpc: UnaryCall[Req, Resp], request: Req, timeout_s: float | None = None
    ) -> Resp:
        """One unary call of a generated stub method, its errors as the project's exceptions."""
        try:
            return rpc(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise convert_rpc_error(e) from None

    def _ns_call(
        self, rpc: UnaryCall[NsReq, Resp], request: NsReq, timeout_s: float | None = None
    ) -> Resp:
        """A call on a namespace; re-registers it once if the server forgot it (restart)."""
        try:
            return self._call(rpc, request, timeout_s)
        except errors.UnknownNamespace:
            ns = self._namespaces.get(bytes(request.namespace_id))
            if ns is None:
                raise
            self.register_namespace(ns)
            return self._call(rpc, request, timeout_s)

    def _session_call(
        self, rpc: UnaryCall[NsReq, Resp], make_request: Callable[[str], NsReq]
    ) -> tuple[_Session, Resp]:
        """A call that needs a live session; opens a new one once if the old one is gone."""
        for attempt in (0, 1):
            session = self._live_session()
            try:
                return session, self._ns_call(rpc, make_request(session.session_id))
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
                event = first_event(stream, self.timeout_s)
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
        resp: pb.RegisterNamespaceResponse = self._call(
            self._stub.RegisterNamespace,
            pb.RegisterNamespaceRequest(namespace=namespace_to_pb(namespace)),
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
            if local is not None:  # the index holds first-tier chunks: the arena, host memory
                num_hits, tier_name = local
                return LookupResult(num_hits, [tier_name] * num_hits, ["host_memory"] * num_hits)
        resp: pb.LookupResponse = self._ns_call(
            self._stub.Lookup,
            pb.LookupRequest(namespace_id=namespace_id, chunk_hashes=chunk_hashes),
            timeout_s,
        )
        media = [medium_from_pb(m) for m in resp.media]
        return LookupResult(resp.num_hit_chunks, list(resp.tiers), media)

    # -- shared-memory path --------------------------------------------------------------

    def prepare_store(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], *, ttl_s: float = 0.0
    ) -> list[StoreSlot]:
        """Reserve slots; write each 'reserved' buffer, then ``commit_store`` those hashes.
        ``ttl_s``: how long the reservations last (0: the server's default)."""
        session, resp = self._session_call(
            self._stub.PrepareStore,
            lambda sid: pb.PrepareStoreRequest(
                namespace_id=namespace_id,
                chunk_hashes=chunk_hashes,
                session_id=sid,
                ttl_ms=round(ttl_s * 1000),
            ),
        )
        prepared: pb.PrepareStoreResponse = resp
        return store_slots(prepared, self._mapping_for(session, prepared.segment_name))

    def commit_store(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], *, abort: bool = False
    ) -> int:
        session = self._live_session()
        resp: pb.CommitStoreResponse = self._ns_call(
            self._stub.CommitStore,
            pb.CommitStoreRequest(
                namespace_id=namespace_id,
                chunk_hashes=chunk_hashes,
                session_id=session.session_id,
                abort=abort,
            ),
        )
        return int(resp.num_committed)

    def bind_store(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], reserved_as: Sequence[bytes]
    ) -> tuple[int, list[bytes]]:
        """Commit chunks written into pooled slots (``reserved_as[i]``: the placeholder hash
        the slot holding ``chunk_hashes[i]`` was reserved for; see ``StorePool``). Returns
        (chunks committed, placeholders still reserved because their chunk was stored)."""
        session = self._live_session()
        resp: pb.CommitStoreResponse = self._ns_call(
            self._stub.CommitStore,
            pb.CommitStoreRequest(
                namespace_id=namespace_id,
                chunk_hashes=chunk_hashes,
                session_id=session.session_id,
                reserved_as=reserved_as,
            ),
        )
        return int(resp.num_committed), [bytes(k) for k in resp.kept]

    @property
    def session_id(self) -> str | None:
        """The open session's id (None before one is opened); a new one after a restart."""
        session = self._session
        return session.session_id if session is not None and session.alive else None

    def prepare_load(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], *, verify: bool = False
    ) -> LoadLease:
        """Lease the longest available prefix; read the (read-only) buffers, then
        ``release_load``. ``verify``: the server first checks each chunk against its checksum
        and leases only the intact prefix."""
        session, resp = self._session_call(
            self._stub.PrepareLoad,
            lambda sid: pb.PrepareLoadRequest(
                namespace_id=namespace_id, chunk_hashes=chunk_hashes, session_id=sid, verify=verify
            ),
        )
        leased: pb.PrepareLoadResponse = resp
        if not leased.lease_id:
            return LoadLease(None)
        return load_lease(leased, self._mapping_for(session, leased.segment_name))

    def release_load(self, lease: LoadLease) -> bool:
        if lease.lease_id is None:
            return False
        resp: pb.ReleaseLoadResponse = self._call(
            self._stub.ReleaseLoad, pb.ReleaseLoadRequest(lease_id=lease.lease_id)
        )
        return bool(resp.released)

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
        resp: pb.DeleteResponse = self._ns_call(
            self._stub.Delete,
            pb.DeleteRequest(namespace_id=namespace_id, chunk_hashes=chunk_hashes),
        )
        return int(resp.num_deleted)

    def stats(self) -> dict[str, Any]:
        resp: pb.StatsResponse = self._call(self._stub.Stats, pb.StatsRequest())
        return stats_dict(resp)

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
        resp: pb.ListMemoriesResponse = self._call(
            self._memories.ListMemories, pb.ListMemoriesRequest()
        )
        return [memory_info_from_pb(m) for m in resp.memories]

    def delete_memory(self, memory_id: str) -> bool:
        """Delete a memory; False when there was none."""
        resp: pb.DeleteMemoryResponse = self._call(
            self._memories.DeleteMemory, pb.DeleteMemoryRequest(memory_id=memory_id)
        )
        return bool(resp.deleted)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until the server answers (raises ServerUnavailable after ``timeout_s``)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise errors.ServerUnavailable(
                f"no lmcache-svc server answered at {self._target} within {timeout_s} s"
            ) from None

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

With ``local_lookup``, ``lookup`` is answered from the server's shared-memory lookup index
when it can be (``shm.index_reader.answer_locally``), and counted for the server's metrics
(``lookup_reports.py``); ``read_in_place`` locates a load's chunks there too and reads them
without a lease (``in_place.py``). The named-memory calls come from ``memories.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from lmcache_svc import errors
from lmcache_svc.client.events import ChunkTokens, EventsSource
from lmcache_svc.client.in_place import InPlaceRead, read_in_place
from lmcache_svc.client.lookup_reports import (
    DEFAULT_REPORT_INTERVAL_S,
    REPORT_TIMEOUT_S,
    LookupCounts,
    LookupReporter,
)
from lmcache_svc.client.memories import MemoryCalls
from lmcache_svc.client.session import Session
from lmcache_svc.client.transport import (
    GetAssembler,
    LoadLease,
    NsReq,
    Resp,
    StoreSlot,
    UnaryCall,
    check_mapping,
    convert_rpc_error,
    load_lease,
    put_parts,
    stats_dict,
    store_slots,
)
from lmcache_svc.keys import Namespace, NamespaceId
from lmcache_svc.results import LookupResult, Placement
from lmcache_svc.shm.arena import ArenaMapping
from lmcache_svc.shm.index_reader import answer_locally
from lmcache_svc.v1 import cache_pb2 as pb
from lmcache_svc.wire import medium_from_pb, namespace_to_pb


class CacheClient(MemoryCalls):
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
        report_interval_s: float = DEFAULT_REPORT_INTERVAL_S,
    ) -> None:
        """``local_lookup``: answer ``lookup`` from the server's shared-memory index when the
        session (opened by any shared-memory call, or ``shm_available``) mapped it here; such
        lookups reach the server's lookup metrics in a report sent every
        ``report_interval_s`` and at ``close`` (``lookup_reports.py``)."""
        super().__init__(address, timeout_s=timeout_s, auth_token=auth_token)
        self._client_name = client_name
        self._use_shm = use_shm
        self._local_lookup = local_lookup
        self._reports = LookupReporter(self._send_report, interval_s=report_interval_s)
        self._namespaces: dict[bytes, Namespace] = {}
        self._events: dict[bytes, EventsSource] = {}
        self._session: Session | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._reports.close()
        with self._lock:
            if self._session is not None:
                self._session.close()
                self._session = None
        self._channel.close()

    # -- plumbing ------------------------------------------------------------------------

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
    ) -> tuple[Session, Resp]:
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

    def _live_session(self) -> Session:
        with self._lock:
            if self._session is None or not self._session.alive:
                self._session = Session.open(
                    self._stub, self._client_name, self._metadata, self.timeout_s
                )
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
        if resp.events_topic:
            self._events[bytes(resp.namespace_id)] = EventsSource(
                resp.events_topic, resp.events_endpoint, resp.events_replay_endpoint or None
            )
        else:
            self._events.pop(bytes(resp.namespace_id), None)
        return NamespaceId(bytes(resp.namespace_id))

    def events_source(self, namespace_id: bytes) -> EventsSource | None:
        """Where the server announces this namespace's chunks (KV events, docs/events.md),
        as of its last registration; None when they are not published."""
        return self._events.get(bytes(namespace_id))

    def lookup(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], *, timeout_s: float | None = None
    ) -> LookupResult:
        local = self.lookup_local(namespace_id, chunk_hashes)
        if local is not None:
            return local
        resp: pb.LookupResponse = self._ns_call(
            self._stub.Lookup,
            pb.LookupRequest(namespace_id=namespace_id, chunk_hashes=chunk_hashes),
            timeout_s,
        )
        media = [medium_from_pb(m) for m in resp.media]
        return LookupResult(resp.num_hit_chunks, list(resp.tiers), media)

    def lookup_local(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes]
    ) -> LookupResult | None:
        """``lookup``'s answer from the server's shared-memory lookup index, with no round
        trip; None when this client has no index mapped (another host, ``local_lookup``
        off, no session yet) or the index cannot tell (see ``answer_locally``)."""
        session = self._session
        ns = self._namespaces.get(bytes(namespace_id))
        if not self._local_lookup or session is None or not session.alive or ns is None:
            return None
        local = answer_locally(session.indexes, ns.tenant, namespace_id, chunk_hashes)
        if local is not None:
            self._reports.count(namespace_id, len(chunk_hashes), local.num_hit_chunks)
        return local

    def flush_lookup_reports(self) -> int:
        """Report the lookups answered from the index so far now, not at the next interval;
        returns how many the server took."""
        return self._reports.flush()

    def _send_report(self, namespace_id: bytes, counts: LookupCounts) -> None:
        """A short deadline: a report never holds ``close`` long on a hung server (its
        counts are then kept for the next report, or lost at close)."""
        self._ns_call(
            self._stub.ReportLookups,
            pb.ReportLookupsRequest(
                namespace_id=namespace_id,
                num_lookups=counts.num_lookups,
                num_chunks=counts.num_chunks,
                num_hit_chunks=counts.num_hit_chunks,
            ),
            min(self.timeout_s, REPORT_TIMEOUT_S),
        )

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
        self,
        namespace_id: bytes,
        chunk_hashes: Sequence[bytes],
        *,
        abort: bool = False,
        described: ChunkTokens | None = None,
    ) -> int:
        """Publish written slots (or give them back); ``described``: the chunks' token ids
        and parents, for the server's KV events."""
        resp = self._commit(namespace_id, chunk_hashes, abort=abort, described=described)
        return int(resp.num_committed)

    def bind_store(
        self,
        namespace_id: bytes,
        chunk_hashes: Sequence[bytes],
        reserved_as: Sequence[bytes],
        *,
        described: ChunkTokens | None = None,
    ) -> tuple[int, list[bytes]]:
        """Commit chunks written into pooled slots (``reserved_as[i]``: the placeholder hash
        the slot holding ``chunk_hashes[i]`` was reserved for; see ``StorePool``). Returns
        (chunks committed, placeholders still reserved because their chunk was stored)."""
        resp = self._commit(
            namespace_id, chunk_hashes, reserved_as=reserved_as, described=described
        )
        return int(resp.num_committed), [bytes(k) for k in resp.kept]

    def _commit(
        self,
        namespace_id: bytes,
        chunk_hashes: Sequence[bytes],
        *,
        abort: bool = False,
        reserved_as: Sequence[bytes] = (),
        described: ChunkTokens | None = None,
    ) -> pb.CommitStoreResponse:
        """One CommitStore in the live session (``commit_store`` and ``bind_store``)."""
        request = pb.CommitStoreRequest(
            namespace_id=namespace_id,
            chunk_hashes=chunk_hashes,
            session_id=self._live_session().session_id,
            abort=abort,
            reserved_as=reserved_as,
        )
        if described is not None and not abort:
            request.token_ids, request.parent_hashes[:] = described.for_chunks(chunk_hashes)
        resp: pb.CommitStoreResponse = self._ns_call(self._stub.CommitStore, request)
        return resp

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

    def read_in_place(
        self,
        namespace_id: bytes,
        chunk_hashes: Sequence[bytes],
        placement: Placement | None = None,
    ) -> InPlaceRead | None:
        """Views of every chunk's bytes in the mapped arena, located through the lookup
        index (or where ``placement``, a local lookup's, says), with no round trip and no
        lease (``in_place.py``: copy, then check ``unchanged()``, then ``touch``); None
        when they cannot all be located so."""
        ns = self._namespaces.get(bytes(namespace_id))
        if ns is None or not self._use_shm:
            return None
        return read_in_place(self._session, ns, chunk_hashes, placement)

    def touch(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> int:
        """Tell the server about chunks read in place: they become its most recently used
        and count as read; returns how many it still held."""
        resp: pb.TouchChunksResponse = self._ns_call(
            self._stub.TouchChunks,
            pb.TouchChunksRequest(namespace_id=namespace_id, chunk_hashes=chunk_hashes),
        )
        return resp.num_touched

    def release_load(self, lease: LoadLease) -> bool:
        if lease.lease_id is None:
            return False
        resp: pb.ReleaseLoadResponse = self._call(
            self._stub.ReleaseLoad, pb.ReleaseLoadRequest(lease_id=lease.lease_id)
        )
        return bool(resp.released)

    def _mapping_for(self, session: Session, segment_name: str) -> ArenaMapping:
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

    def put(
        self,
        namespace_id: bytes,
        items: Sequence[tuple[bytes, Any]],
        *,
        described: ChunkTokens | None = None,
    ) -> int:
        """Inline store (streamed); returns the chunks stored (or already stored).
        ``described``: the chunks' token ids and parents, for the server's KV events."""
        try:
            resp = self._stub.Put(
                put_parts(namespace_id, items, described),
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

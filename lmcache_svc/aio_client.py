"""The asyncio Python client of the cache server: ``AsyncCacheClient``.

Same contract as the blocking ``CacheClient`` (``client.py``): the shared-memory path
(``prepare_store``/``commit_store``, ``prepare_load``/``release_load``) when the server's
segment can be mapped here, inline streams otherwise, and automatic recovery of namespaces
and sessions after a server restart."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from lmcache_svc import errors
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
from lmcache_svc.v1 import cache_pb2 as pb
from lmcache_svc.v1 import cache_pb2_grpc as pb_grpc
from lmcache_svc.wire import medium_from_pb, memory_info_from_pb, namespace_to_pb


class _AsyncSession:
    """An open session stream and the mapped segment; dead once the stream ends."""

    def __init__(self, call: Any, event: pb.SessionEvent) -> None:
        self.session_id = event.session_id
        self.mapping, self.segment_name = map_segment(event)
        self._call = call
        self.alive = True
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        try:
            while await self._call.read() is not grpc.aio.EOF:
                pass
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        self.alive = False

    def close(self) -> None:
        self.alive = False
        self._call.cancel()


class AsyncCacheClient:
    """asyncio client; one per event loop. Use ``async with`` or ``await close()``."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 5.0,
        client_name: str = "",
        use_shm: bool = True,
        auth_token: str | None = None,
    ) -> None:
        self._target = grpc_target(address)
        self.timeout_s = timeout_s
        self._metadata = auth_metadata(auth_token)
        self._channel = grpc.aio.insecure_channel(self._target, options=client_channel_options())
        self._stub = pb_grpc.CacheServiceStub(self._channel)
        self._memories = pb_grpc.MemoryServiceStub(self._channel)
        self._namespaces: dict[bytes, Namespace] = {}
        self._client_name = client_name
        self._use_shm = use_shm
        self._session: _AsyncSession | None = None
        self._session_lock = asyncio.Lock()

    async def __aenter__(self) -> AsyncCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
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
        media = [medium_from_pb(m) for m in resp.media]
        return LookupResult(resp.num_hit_chunks, list(resp.tiers), media)

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

    async def get(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], *, verify: bool = False
    ) -> list[bytes | None]:
        assembler = GetAssembler()
        try:
            call = self._stub.Get(
                pb.GetRequest(namespace_id=namespace_id, chunk_hashes=chunk_hashes, verify=verify),
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

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Wait until the server answers (raises ServerUnavailable after ``timeout_s``)."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except asyncio.TimeoutError:
            raise errors.ServerUnavailable(
                f"no lmcache-svc server answered at {self._target} within {timeout_s} s"
            ) from None

    # -- named memories (same semantics as CacheClient's) -------------------------------------

    async def put_memory(self, blob: bytes | bytearray | memoryview) -> MemoryInfo:
        try:
            resp = await self._memories.PutMemory(
                memory_parts(blob),
                timeout=memory_timeout(self.timeout_s, memoryview(blob).nbytes),
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            raise convert_rpc_error(e) from None
        return memory_info_from_pb(resp.memory)

    async def get_memory(self, memory_id: str) -> bytes | None:
        try:
            call = self._memories.GetMemory(
                pb.GetMemoryRequest(memory_id=memory_id),
                timeout=memory_timeout(self.timeout_s, 1 << 30),
                metadata=self._metadata,
            )
            return join_memory_parts([part async for part in call])
        except grpc.RpcError as e:
            raise convert_rpc_error(e) from None

    async def list_memories(self) -> list[MemoryInfo]:
        resp = await self._memory_call("ListMemories", pb.ListMemoriesRequest())
        return [memory_info_from_pb(m) for m in resp.memories]

    async def delete_memory(self, memory_id: str) -> bool:
        resp = await self._memory_call("DeleteMemory", pb.DeleteMemoryRequest(memory_id=memory_id))
        return bool(resp.deleted)

    async def _memory_call(self, method: str, request: Any) -> Any:
        try:
            return await getattr(self._memories, method)(
                request, timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise convert_rpc_error(e) from None

    # -- shared-memory path ------------------------------------------------------------------

    async def _live_session(self) -> _AsyncSession:
        async with self._session_lock:
            if self._session is not None and self._session.alive:
                return self._session
            call = self._stub.OpenSession(
                pb.OpenSessionRequest(client_name=self._client_name), metadata=self._metadata
            )
            try:
                event = await asyncio.wait_for(call.read(), self.timeout_s)
            except (grpc.RpcError, asyncio.TimeoutError) as e:
                call.cancel()
                if isinstance(e, grpc.RpcError):
                    raise convert_rpc_error(e) from None
                raise errors.ServerUnavailable(
                    f"no session from the server within {self.timeout_s} s"
                ) from None
            if event is grpc.aio.EOF:
                raise errors.ServerUnavailable("the server closed the session stream")
            self._session = _AsyncSession(call, event)
            return self._session

    async def shm_available(self) -> bool:
        """True when the server's segment is mapped here (same host); opens a session."""
        if not self._use_shm:
            return False
        try:
            return (await self._live_session()).mapping is not None
        except errors.ServerUnavailable:
            return False

    async def _session_call(self, method: str, make_request: Any) -> tuple[_AsyncSession, Any]:
        """A call that needs a live session; opens a new one once if the old one is gone."""
        for attempt in (0, 1):
            session = await self._live_session()
            try:
                return session, await self._ns_call(method, make_request(session.session_id))
            except errors.UnknownSession:
                if self._session is session:
                    self._session = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _mapping_for(self, session: _AsyncSession, segment_name: str) -> ArenaMapping:
        try:
            return check_mapping(session.mapping, session.segment_name, segment_name)
        except errors.ServerUnavailable:
            self._session = None
            raise

    async def prepare_store(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes]
    ) -> list[StoreSlot]:
        """Reserve slots; write each 'reserved' buffer, then ``commit_store`` those hashes."""
        session, resp = await self._session_call(
            "PrepareStore",
            lambda sid: pb.PrepareStoreRequest(
                namespace_id=namespace_id, chunk_hashes=chunk_hashes, session_id=sid
            ),
        )
        return store_slots(resp, self._mapping_for(session, resp.segment_name))

    async def commit_store(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], *, abort: bool = False
    ) -> int:
        session = await self._live_session()
        resp = await self._ns_call(
            "CommitStore",
            pb.CommitStoreRequest(
                namespace_id=namespace_id,
                chunk_hashes=chunk_hashes,
                session_id=session.session_id,
                abort=abort,
            ),
        )
        return int(resp.num_committed)

    async def prepare_load(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], *, verify: bool = False
    ) -> LoadLease:
        """Lease the longest available prefix; read the (read-only) buffers, then
        ``release_load``. ``verify``: the server first checks each chunk against its checksum
        and leases only the intact prefix."""
        session, resp = await self._session_call(
            "PrepareLoad",
            lambda sid: pb.PrepareLoadRequest(
                namespace_id=namespace_id, chunk_hashes=chunk_hashes, session_id=sid, verify=verify
            ),
        )
        if not resp.lease_id:
            return LoadLease(None)
        return load_lease(resp, self._mapping_for(session, resp.segment_name))

    async def release_load(self, lease: LoadLease) -> bool:
        if lease.lease_id is None:
            return False
        resp = await self._call("ReleaseLoad", pb.ReleaseLoadRequest(lease_id=lease.lease_id))
        return bool(resp.released)

    async def store(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], buffers: Sequence[Any]
    ) -> int:
        """Store chunks (shared memory when available, else inline); returns chunks stored."""
        if not await self.shm_available():
            return await self.put(namespace_id, list(zip(chunk_hashes, buffers)))
        slots = await self.prepare_store(namespace_id, chunk_hashes)
        reserved = [s.chunk_hash for s in slots if s.status == "reserved"]
        try:
            for slot, data in zip(slots, buffers):
                if slot.buffer is not None:
                    slot.buffer[:] = memoryview(data).cast("B")
        except BaseException:
            await self.commit_store(namespace_id, reserved, abort=True)
            raise
        committed = await self.commit_store(namespace_id, reserved)
        return committed + sum(s.status == "already_stored" for s in slots)

    async def load(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], *, verify: bool = False
    ) -> list[bytes]:
        """Bytes of the longest available prefix (shared memory when available, else inline);
        ``verify``: only chunks that match their checksums."""
        if not await self.shm_available():
            out: list[bytes] = []
            for data in await self.get(namespace_id, chunk_hashes, verify=verify):
                if data is None:
                    break
                out.append(data)
            return out
        lease = await self.prepare_load(namespace_id, chunk_hashes, verify=verify)
        try:
            return [bytes(b) for b in lease.buffers]
        finally:
            await self.release_load(lease)

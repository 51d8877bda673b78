"""The client's named-memory calls (``docs/memories.md``), part of ``CacheClient``."""

from __future__ import annotations

import grpc

from lmcache_svc.client.channel import ClientChannel
from lmcache_svc.client.transport import (
    convert_rpc_error,
    join_memory_parts,
    memory_parts,
    memory_timeout,
)
from lmcache_svc.memory_blob import MemoryInfo
from lmcache_svc.v1 import cache_pb2 as pb
from lmcache_svc.wire import memory_info_from_pb


class MemoryCalls(ClientChannel):
    """Store, read, list and delete this tenant's named memories over the MemoryService."""

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

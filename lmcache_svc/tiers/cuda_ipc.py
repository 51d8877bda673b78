"""CUDA IPC handles of a device buffer, as plain fields (no pickle across processes).

The sidecar exports its HBM pool with torch's storage-level IPC calls
(``UntypedStorage._share_cuda_()``); an engine process on the same host opens it with
``UntypedStorage._new_shared_cuda(...)`` and then copies device to device. The eight fields
torch returns travel as bytes and ints (``CudaIpcHandle``; the wire form is the protobuf
message ``lmcache_svc.v1.CudaIpcHandle``), never as a pickled object.

CUDA only: ``export_handle`` and ``open_handle`` need a CUDA build of torch and a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class CudaIpcHandle:
    """What ``UntypedStorage._share_cuda_()`` returns, field by field."""

    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    def to_proto(self) -> Any:
        from lmcache_svc.v1 import device_pb2

        return device_pb2.CudaIpcHandle(
            device=self.device,
            handle=self.handle,
            storage_size_bytes=self.storage_size_bytes,
            storage_offset_bytes=self.storage_offset_bytes,
            ref_counter_handle=self.ref_counter_handle,
            ref_counter_offset=self.ref_counter_offset,
            event_handle=self.event_handle,
            event_sync_required=self.event_sync_required,
        )

    @classmethod
    def from_proto(cls, msg: Any) -> CudaIpcHandle:
        return cls(
            device=msg.device,
            handle=bytes(msg.handle),
            storage_size_bytes=msg.storage_size_bytes,
            storage_offset_bytes=msg.storage_offset_bytes,
            ref_counter_handle=bytes(msg.ref_counter_handle),
            ref_counter_offset=msg.ref_counter_offset,
            event_handle=bytes(msg.event_handle),
            event_sync_required=msg.event_sync_required,
        )


def export_handle(buffer: torch.Tensor) -> CudaIpcHandle:
    """The IPC handle of the CUDA storage behind ``buffer`` (a whole-storage uint8 tensor)."""
    if buffer.device.type != "cuda":
        raise ValueError(f"only CUDA memory has IPC handles, got a {buffer.device} tensor")
    if buffer.storage_offset() != 0 or buffer.dtype != torch.uint8:
        raise ValueError("export the pool's whole uint8 buffer, not a view into it")
    fields = buffer.untyped_storage()._share_cuda_()
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = fields
    return CudaIpcHandle(
        int(device),
        bytes(handle),
        int(size),
        int(offset),
        bytes(ref_handle),
        int(ref_offset),
        bytes(event_handle or b""),
        bool(event_sync),
    )


def open_handle(h: CudaIpcHandle) -> torch.Tensor:
    """Map an exported buffer in this process: a uint8 tensor over the same device bytes."""
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        h.device,
        h.handle,
        h.storage_size_bytes,
        h.storage_offset_bytes,
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle,
        h.event_sync_required,
    )
    out = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", h.device))
    out.set_(storage, 0, (h.storage_size_bytes,), (1,))
    return out

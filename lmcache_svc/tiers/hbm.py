"""The HBM tier: chunks in a GPU memory pool owned by the sidecar.

One flat device buffer (``DevicePool``), carved into slots by the same size-class slab
allocator as the shared-memory arena. To the cache it is a tier like any other (``put`` /
``read_into`` copy host bytes in and out, ``put`` answers ``False`` when full), so capacity,
LRU, demotion to the next tier and promotion into the arena all come from the cache's policy,
with no tier-name checks. For engines on the same host the pool is exported as a CUDA IPC
handle (``export_handle``, fields in ``cuda_ipc.CudaIpcHandle``) and each chunk's place in
it is ``slot_of(key)``: an engine that maps the pool copies a hit device to device.

``DevicePool`` is the allocator seam: ``DevicePool.allocate`` makes the CUDA buffer (after
``require_cuda``); tests hand in a CPU tensor, which exercises all of the tier but IPC.

A slot being read is pinned, as in the CPU tier (``own_slots.ReadPins``): deleting or
replacing its key meanwhile frees it when the last read ends.
"""

from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING

from lmcache_svc.errors import ConfigError, InvalidArgument
from lmcache_svc.keys import ChunkKey
from lmcache_svc.shm.slab import SlabAllocator
from lmcache_svc.tiers.base import Buffer, Slot
from lmcache_svc.tiers.own_slots import OwnSlotsTier, ReadPins

if TYPE_CHECKING:
    import torch

    from lmcache_svc.tiers.cuda_ipc import CudaIpcHandle


def require_cuda(device: int, *, field: str = "hbm.capacity") -> None:
    """Raise ``ConfigError`` naming ``field`` unless torch sees CUDA device ``device``."""
    try:
        import torch
    except ImportError:
        raise ConfigError(
            f"{field} is set (HBM tier) but torch is not installed: install the [torch] extra "
            "with a CUDA build of torch, or unset it"
        ) from None
    if not torch.cuda.is_available():
        raise ConfigError(
            f"{field} is set (HBM tier) but CUDA is not available here "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False): unset it"
        )
    if device >= torch.cuda.device_count():
        raise ConfigError(
            f"hbm.device is {device} but only {torch.cuda.device_count()} CUDA device(s) exist"
        )


class DevicePool:
    """One flat uint8 buffer: device memory in production, any tensor in tests."""

    def __init__(self, buffer: torch.Tensor) -> None:
        import torch

        if buffer.dtype != torch.uint8 or buffer.ndim != 1 or not buffer.is_contiguous():
            raise ValueError("a device pool is one contiguous 1-D uint8 tensor")
        self.buffer = buffer
        self.nbytes = buffer.numel()

    @classmethod
    def allocate(cls, nbytes: int, device: int) -> DevicePool:
        import torch

        require_cuda(device)
        return cls(torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", device)))

    def export_handle(self) -> CudaIpcHandle:
        from lmcache_svc.tiers.cuda_ipc import export_handle

        return export_handle(self.buffer)


class HbmTier(OwnSlotsTier):
    """A ``Tier`` over a ``DevicePool``, which it owns. Thread-safe."""

    medium = "device"

    def __init__(self, pool: DevicePool, *, slab_bytes: int, name: str = "hbm") -> None:
        self.name = name
        self.capacity_bytes = pool.nbytes
        self._pool: DevicePool | None = pool
        self._alloc = SlabAllocator(0, pool.nbytes, slab_bytes)
        self._lock = threading.Lock()
        self._slots: dict[ChunkKey, Slot] = {}
        self._reads = ReadPins(self._free_slot)

    @property
    def used_bytes(self) -> int:
        return self._alloc.used_bytes

    def _bytes(self, slot: Slot) -> torch.Tensor:
        if self._pool is None:
            raise RuntimeError(f"tier {self.name!r} is closed")
        return self._pool.buffer[slot.offset : slot.offset + slot.length]

    def put(self, key: ChunkKey, data: Buffer) -> bool:
        if not memoryview(data).nbytes:
            raise InvalidArgument(f"empty chunk for {key.hex()}")
        return super().put(key, data)

    def _take(self, nbytes: int) -> Slot | None:
        with self._lock:
            offset = self._alloc.allocate(nbytes)
        return None if offset is None else Slot(offset, nbytes)

    def _find(self, key: ChunkKey) -> Slot | None:
        return self._slots.get(key)

    def _set(self, key: ChunkKey, slot: Slot) -> Slot | None:
        old = self._slots.get(key)
        self._slots[key] = slot
        return old

    def _copy_in(self, slot: Slot, src: memoryview) -> None:
        self._bytes(slot).copy_(_host_tensor(src))

    def _copy_out(self, slot: Slot, out: memoryview) -> None:
        _host_tensor(out.cast("B")).copy_(self._bytes(slot))

    def _free_slot(self, slot: Slot) -> None:
        self._alloc.free(slot.offset, slot.length)

    def size_of(self, key: ChunkKey) -> int | None:
        slot = self._slots.get(key)
        return None if slot is None else slot.length

    def delete(self, key: ChunkKey) -> int:
        with self._lock:
            slot = self._slots.pop(key, None)
            if slot is None:
                return 0
            freed = self._alloc.class_bytes_of(slot.offset) or 0
            self._reads.release(slot)
        return freed

    def slot_of(self, key: ChunkKey) -> Slot | None:
        """Where the chunk lies in the exported pool (for engines that mapped it)."""
        return self._slots.get(key)

    def export_handle(self) -> CudaIpcHandle:
        if self._pool is None:
            raise RuntimeError(f"tier {self.name!r} is closed")
        return self._pool.export_handle()

    def close(self) -> None:
        with self._lock:
            self._slots.clear()
            self._reads.clear()
            self._pool = None  # the device memory goes back to torch's allocator


def _host_tensor(buffer: memoryview) -> torch.Tensor:
    import torch

    if buffer.readonly:  # only ever a copy source
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given buffer is not writable")
            return torch.frombuffer(buffer, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8)

"""The CPU tier: chunks in the server's shared-memory ``Arena``, one slot per key.

Same-host clients map the arena (``segment()``) and copy into or out of slots in place; the
server copies for inline transfers through ``put`` and ``read_into``. A slot being read is
pinned (``own_slots.ReadPins``): deleting or replacing its key meanwhile frees it only when
the last read ends, so a reader never sees a slot reused under it.

The index holds each slot as one int (page number and length packed), not a ``Slot``
object: an index of millions of chunks is the server's main memory cost beyond the payloads,
and for arenas up to 16 GiB the packed int stays under 2^60 (a 32-byte Python int).
"""

from __future__ import annotations

import threading

from lmcache_svc.keys import ChunkKey
from lmcache_svc.shm.arena import ARENA_TRANSPORT, Arena
from lmcache_svc.shm.slab import ALIGN
from lmcache_svc.tiers.base import SegmentInfo, Slot, SlotTier
from lmcache_svc.tiers.own_slots import OwnSlotsTier, ReadPins


class _SlotPacker:
    """``Slot`` <-> one int: the slot's page number (offsets are page-aligned), then its length."""

    def __init__(self, max_length: int) -> None:
        self.length_bits = max_length.bit_length()
        self.length_mask = (1 << self.length_bits) - 1

    def pack(self, slot: Slot) -> int:
        if slot.offset % ALIGN or not 0 < slot.length <= self.length_mask:
            raise RuntimeError(f"slot {slot} is not page-aligned or too long to pack")
        return (slot.offset // ALIGN) << self.length_bits | slot.length

    def unpack(self, packed: int) -> Slot:
        return Slot((packed >> self.length_bits) * ALIGN, packed & self.length_mask)


class CpuTier(OwnSlotsTier, SlotTier):
    """A ``SlotTier`` over an ``Arena``, which it owns: ``close`` closes the arena. Thread-safe."""

    medium = "host_memory"

    def __init__(self, arena: Arena, *, name: str = "cpu") -> None:
        self.name = name
        self.capacity_bytes = arena.capacity_bytes
        self._arena = arena
        self._lock = threading.Lock()
        self._slots: dict[ChunkKey, int] = {}  # packed slots
        self._packer = _SlotPacker(arena.capacity_bytes)
        self._reads = ReadPins(self._arena.free)

    @property
    def arena(self) -> Arena:
        return self._arena

    @property
    def used_bytes(self) -> int:
        """Bytes taken from the arena (size classes), slots still being read included."""
        return self._arena.used_bytes

    def allocate(self, key: ChunkKey, nbytes: int) -> Slot | None:
        with self._lock:
            if key in self._slots:
                raise RuntimeError(f"tier {self.name!r}: key {key.hex()} already has a slot")
            slot = self._arena.allocate(nbytes)
            if slot is not None:
                self._slots[key] = self._packer.pack(slot)
        return slot

    def rename(self, old: ChunkKey, new: ChunkKey) -> None:
        with self._lock:
            if new in self._slots:
                raise RuntimeError(f"tier {self.name!r}: key {new.hex()} already has a slot")
            self._slots[new] = self._slots.pop(old)

    def _take(self, nbytes: int) -> Slot | None:
        return self._arena.allocate(nbytes)

    def _find(self, key: ChunkKey) -> Slot | None:
        packed = self._slots.get(key)
        return None if packed is None else self._packer.unpack(packed)

    def _set(self, key: ChunkKey, slot: Slot) -> Slot | None:
        old = self._slots.get(key)
        self._slots[key] = self._packer.pack(slot)
        return None if old is None else self._packer.unpack(old)

    def _copy_in(self, slot: Slot, src: memoryview) -> None:
        self._arena.view(slot)[:] = src

    def _copy_out(self, slot: Slot, out: memoryview) -> None:
        out.cast("B")[:] = self._arena.view(slot)

    def size_of(self, key: ChunkKey) -> int | None:
        packed = self._slots.get(key)
        return None if packed is None else packed & self._packer.length_mask

    def delete(self, key: ChunkKey) -> int:
        """Drop ``key``; returns the arena bytes (its size class) it frees, now or after reads."""
        with self._lock:
            packed = self._slots.pop(key, None)
            if packed is None:
                return 0
            slot = self._packer.unpack(packed)
            freed = self._arena.class_bytes_of(slot)
            self._reads.release(slot)
        return freed

    def slot_of(self, key: ChunkKey) -> Slot | None:
        packed = self._slots.get(key)
        return None if packed is None else self._packer.unpack(packed)

    def view(self, slot: Slot) -> memoryview:
        return self._arena.view(slot)

    def segment(self) -> SegmentInfo:
        arena = self._arena
        return SegmentInfo(ARENA_TRANSPORT, arena.name, arena.segment_size, arena.nonce)

    def close(self) -> None:
        with self._lock:
            self._slots.clear()
            self._reads.clear()
        self._arena.close()

"""Tiers that keep each chunk in a slot of memory they own and copy bytes in and out of it
(the CPU arena, the HBM pool): ``OwnSlotsTier`` gives them ``put`` and ``read_into``.

A read pins its slot for the copy (``ReadPins``); a slot dropped from the tier's index
meanwhile (deleted, or replaced by a newer value) becomes an orphan, freed by its last
reader, so a reader never sees a slot reused under it. One lock per tier guards its index
and its pins together, so a pin and an index change never interleave.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from lmcache_svc.errors import InvalidArgument
from lmcache_svc.keys import ChunkKey
from lmcache_svc.tiers.base import Buffer, Slot, Tier


class ReadPins:
    """The slots being read and the orphans among them. Not thread-safe on its own: the
    tier calls every method under its lock."""

    def __init__(self, free: Callable[[Slot], None]) -> None:
        self._free = free
        self._num_readers: dict[Slot, int] = {}
        self._orphans: set[Slot] = set()  # dropped from the index while being read

    def begin(self, slot: Slot) -> None:
        """A read of ``slot`` starts (the slot is in the index)."""
        self._num_readers[slot] = self._num_readers.get(slot, 0) + 1

    def end(self, slot: Slot) -> None:
        """A read of ``slot`` ends; the last reader of an orphan frees it."""
        left = self._num_readers.pop(slot) - 1
        if left:
            self._num_readers[slot] = left
        elif slot in self._orphans:
            self._orphans.remove(slot)
            self._free(slot)

    def release(self, slot: Slot) -> None:
        """``slot`` was dropped from the index: free it now, or defer it to its last reader."""
        if slot in self._num_readers:
            self._orphans.add(slot)
        else:
            self._free(slot)

    def clear(self) -> None:
        self._num_readers.clear()
        self._orphans.clear()


class OwnSlotsTier(Tier):
    """``put``, ``read_into`` and the index queries over the hooks a tier with its own slots
    provides. The tier sets ``_lock`` (guards the index and ``_reads``), ``_slots`` (its
    index: key to the slot, in whatever form the tier keeps it) and ``_reads`` in
    ``__init__``."""

    _lock: threading.Lock
    _slots: dict[ChunkKey, Any]
    _reads: ReadPins

    @property
    def num_chunks(self) -> int:
        return len(self._slots)

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        slots = self._slots
        return [key in slots for key in keys]

    @abstractmethod
    def _take(self, nbytes: int) -> Slot | None:
        """Room for ``nbytes`` not yet in the index, or None when full (takes its own lock)."""

    @abstractmethod
    def _find(self, key: ChunkKey) -> Slot | None:
        """The slot indexed under ``key``. Lock held."""

    @abstractmethod
    def _set(self, key: ChunkKey, slot: Slot) -> Slot | None:
        """Index ``slot`` under ``key``; returns the slot it replaces. Lock held."""

    @abstractmethod
    def _copy_in(self, slot: Slot, src: memoryview) -> None: ...

    @abstractmethod
    def _copy_out(self, slot: Slot, out: memoryview) -> None: ...

    def put(self, key: ChunkKey, data: Buffer) -> bool:
        """Store ``data``; when the tier is full, an old value of ``key`` is dropped first."""
        src = memoryview(data).cast("B")
        slot = self._take(src.nbytes)
        if slot is None and self.delete(key):
            slot = self._take(src.nbytes)
        if slot is None:
            return False
        self._copy_in(slot, src)
        with self._lock:
            old = self._set(key, slot)
            if old is not None:
                self._reads.release(old)
        return True

    def read_into(self, key: ChunkKey, out: memoryview) -> bool:
        with self._lock:
            slot = self._find(key)
            if slot is None:
                return False
            if out.nbytes != slot.length:
                raise InvalidArgument(
                    f"read buffer is {out.nbytes} bytes, chunk {key.hex()} is {slot.length}"
                )
            self._reads.begin(slot)
        try:
            self._copy_out(slot, out)
        finally:
            self._end_read(slot)
        return True

    def _end_read(self, slot: Slot) -> None:
        with self._lock:
            self._reads.end(slot)

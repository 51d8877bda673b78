"""Slots being read, for tiers that copy out of their own slots (CPU, HBM).

A read pins its slot for the copy; a slot dropped from the tier's index meanwhile (deleted,
or replaced by a newer value) becomes an orphan, freed by its last reader, so a reader never
sees a slot reused under it. Not thread-safe on its own: the tier calls every method under
the lock that also guards its index, so a pin and an index change never interleave.
"""

from __future__ import annotations

from collections.abc import Callable

from lmcache_svc.tiers.base import Slot


class ReadPins:
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

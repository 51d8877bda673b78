"""The size-class slab allocator behind the shared-memory arena: offsets only, no memory.

It hands out offsets in ``[base, base + capacity_bytes)``; ``arena.py`` owns the memory,
the lock and the argument checks.

Size classes: a slot's class is its request rounded up to ``ALIGN`` (4096) bytes; the slot
takes its whole class from the capacity (``used_bytes`` sums classes, not requests).

Slabs: the area is cut into slabs of ``slab_bytes`` (the last one may be shorter). A free
slab is given to one class on demand and carved into equal slots lazily, so handing out a
slab costs O(1). When all its slots are free again it goes back to the free-slab pool and
may serve another class. A freed slot is the next one its slab hands out.

Runs: a class larger than one slab takes a run of contiguous free slabs, one slot per run,
and gives all of them back to the pool when freed.

Slabs and runs come from the lowest free addresses first.

Bookkeeping is compact, because an index of millions of small chunks has millions of slots:
a slot costs one list entry (its requested length) in its slab, and an offset is resolved
through the slab it falls in, not through a per-slot dictionary.
"""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass, field
from operator import neg

ALIGN = 4096


def round_up(nbytes: int, align: int = ALIGN) -> int:
    return -(-nbytes // align) * align


@dataclass(slots=True)
class _Slab:
    """One slab given to one size class and carved, on demand, into equal slots."""

    index: int
    start: int
    class_bytes: int
    num_slots: int
    num_carved: int = 0
    num_live: int = 0
    free_offsets: list[int] = field(default_factory=list)
    retired: bool = False
    lengths: list[int | None] = field(default_factory=list)
    """Requested length of each carved slot; None while the slot is free."""

    def take(self, nbytes: int) -> int:
        self.num_live += 1
        if self.free_offsets:
            offset = self.free_offsets.pop()
            self.lengths[(offset - self.start) // self.class_bytes] = nbytes
            return offset
        self.num_carved += 1
        self.lengths.append(nbytes)
        return self.start + (self.num_carved - 1) * self.class_bytes

    def length_at(self, offset: int) -> int | None:
        position, rest = divmod(offset - self.start, self.class_bytes)
        if rest or not 0 <= position < self.num_carved:
            return None
        return self.lengths[position]


@dataclass(frozen=True, slots=True)
class _Run:
    """Contiguous slabs holding one slot of a class larger than a slab."""

    index: int
    num_slabs: int
    class_bytes: int
    length: int


class SlabAllocator:
    """Offsets only, no memory: the size-class slab allocator of an ``Arena``. Not locked."""

    def __init__(self, base: int, capacity_bytes: int, slab_bytes: int) -> None:
        self.base = base
        self.capacity_bytes = capacity_bytes
        self.slab_bytes = slab_bytes
        self.used_bytes = 0
        self._num_slabs = -(-capacity_bytes // slab_bytes)
        self._free_slabs = list(range(self._num_slabs - 1, -1, -1))  # descending: pop() is lowest
        self._partial: dict[int, list[_Slab]] = {}  # class size -> slabs with room (a stack)
        self._owners: list[_Slab | _Run | None] = [None] * self._num_slabs  # by slab index
        self._num_live = 0

    @property
    def num_slots(self) -> int:
        return self._num_live

    def _live(self, offset: int) -> tuple[_Slab | _Run, int] | None:
        """The owner and requested length of the live slot at ``offset``, or None."""
        index = (offset - self.base) // self.slab_bytes
        if not 0 <= index < self._num_slabs:
            return None
        owner = self._owners[index]
        if owner is None:
            return None
        if isinstance(owner, _Run):
            return (owner, owner.length) if offset == self._slab_start(owner.index) else None
        length = owner.length_at(offset)
        return None if length is None else (owner, length)

    def class_bytes_of(self, offset: int) -> int | None:
        entry = self._live(offset)
        return None if entry is None else entry[0].class_bytes

    def length_of(self, offset: int) -> int | None:
        entry = self._live(offset)
        return None if entry is None else entry[1]

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a new slot of ``nbytes`` (validated by the caller), or None if full."""
        class_bytes = round_up(nbytes)
        owner: _Slab | _Run | None
        if class_bytes > self.slab_bytes:
            owner = self._take_run(class_bytes, nbytes)
            offset = None if owner is None else self._slab_start(owner.index)
        else:
            owner = self._slab_with_room(class_bytes)
            offset = None if owner is None else owner.take(nbytes)
        if owner is None or offset is None:
            return None
        self._num_live += 1
        self.used_bytes += class_bytes
        return offset

    def free(self, offset: int, length: int) -> None:
        entry = self._live(offset)
        if entry is None or entry[1] != length:
            raise RuntimeError(
                f"arena free of offset {offset} (length {length}) which is not an allocated "
                f"slot (live length: {None if entry is None else entry[1]})"
            )
        owner = entry[0]
        self._num_live -= 1
        self.used_bytes -= owner.class_bytes
        if isinstance(owner, _Run):
            self._owners[owner.index] = None
            for index in range(owner.index, owner.index + owner.num_slabs):
                insort(self._free_slabs, index, key=neg)
            return
        self._release_from_slab(owner, offset)

    def _release_from_slab(self, slab: _Slab, offset: int) -> None:
        was_full = slab.num_live == slab.num_slots
        slab.num_live -= 1
        slab.lengths[(offset - slab.start) // slab.class_bytes] = None
        if slab.num_live == 0:
            slab.retired = True
            self._owners[slab.index] = None
            insort(self._free_slabs, slab.index, key=neg)
            return
        slab.free_offsets.append(offset)
        if was_full:
            self._partial.setdefault(slab.class_bytes, []).append(slab)

    def _slab_with_room(self, class_bytes: int) -> _Slab | None:
        stack = self._partial.setdefault(class_bytes, [])
        while stack and stack[-1].retired:
            stack.pop()
        if len(stack) > 2 * self._num_slabs:  # retired entries are dropped lazily
            stack[:] = [s for s in stack if not s.retired]
        if stack:
            slab = stack[-1]
            if slab.num_live + 1 == slab.num_slots:
                stack.pop()
            return slab
        return self._carve_new_slab(class_bytes, stack)

    def _carve_new_slab(self, class_bytes: int, stack: list[_Slab]) -> _Slab | None:
        if not self._free_slabs:
            return None
        index = self._free_slabs[-1]
        num_slots = self._slab_len(index) // class_bytes
        if num_slots == 0:  # only the short last slab is free, and it is too short
            return None
        self._free_slabs.pop()
        slab = _Slab(index, self._slab_start(index), class_bytes, num_slots)
        self._owners[index] = slab
        if num_slots > 1:
            stack.append(slab)
        return slab

    def _take_run(self, class_bytes: int, nbytes: int) -> _Run | None:
        need = -(-class_bytes // self.slab_bytes)
        free = self._free_slabs  # descending
        pos = len(free) - 1
        while pos - need + 1 >= 0:
            first = free[pos]
            last_pos = pos - need + 1
            if free[last_pos] == first + need - 1:
                end = min(self._slab_start(first + need), self.base + self.capacity_bytes)
                if end - self._slab_start(first) < class_bytes:
                    return None  # this run ends in the short last slab: nothing further
                del free[last_pos : pos + 1]
                run = _Run(first, need, class_bytes, nbytes)
                self._owners[first] = run
                return run
            pos -= 1
        return None

    def _slab_start(self, index: int) -> int:
        return self.base + index * self.slab_bytes

    def _slab_len(self, index: int) -> int:
        return min(self.slab_bytes, self.capacity_bytes - index * self.slab_bytes)

"""SlabAllocator on its own: offsets from a base, class sizes, runs and misuse, no memory."""

from __future__ import annotations

import pytest

from lmcache_svc.shm.slab import ALIGN, SlabAllocator, round_up

SLAB = 16 * ALIGN
BASE = 3 * ALIGN


def make_allocator(num_slabs: int = 4, extra: int = 0) -> SlabAllocator:
    return SlabAllocator(BASE, num_slabs * SLAB + extra, SLAB)


def take(alloc: SlabAllocator, nbytes: int) -> int:
    offset = alloc.allocate(nbytes)
    assert offset is not None, f"no room for {nbytes} bytes"
    return offset


@pytest.mark.parametrize(
    ("nbytes", "expected"), [(1, ALIGN), (ALIGN, ALIGN), (ALIGN + 1, 2 * ALIGN), (0, 0)]
)
def test_round_up(nbytes: int, expected: int) -> None:
    assert round_up(nbytes) == expected


def test_offsets_start_at_base_and_track_lengths_and_classes() -> None:
    alloc = make_allocator()

    offsets = [take(alloc, n) for n in (1, ALIGN + 1, 2, SLAB + 1)]

    assert offsets == [BASE, BASE + SLAB, BASE + ALIGN, BASE + 2 * SLAB]
    assert [alloc.length_of(o) for o in offsets] == [1, ALIGN + 1, 2, SLAB + 1]
    assert [alloc.class_bytes_of(o) for o in offsets] == [ALIGN, 2 * ALIGN, ALIGN, SLAB + ALIGN]
    assert alloc.used_bytes == 2 * ALIGN + 2 * ALIGN + SLAB + ALIGN
    assert alloc.num_slots == 4
    assert alloc.length_of(BASE + 5 * ALIGN) is None
    assert alloc.class_bytes_of(BASE + 5 * ALIGN) is None


def test_freeing_every_slot_returns_every_slab() -> None:
    alloc = make_allocator()
    offsets = [take(alloc, ALIGN) for _ in range(SLAB // ALIGN + 1)]  # all of slab 0, 1 of slab 1
    run = take(alloc, 2 * SLAB)
    assert run == BASE + 2 * SLAB

    for offset in offsets:
        alloc.free(offset, ALIGN)
    alloc.free(run, 2 * SLAB)

    assert alloc.used_bytes == 0 and alloc.num_slots == 0
    assert alloc.allocate(4 * SLAB) == BASE


def test_run_needs_enough_room_in_the_short_last_slab() -> None:
    alloc = make_allocator(num_slabs=1, extra=ALIGN)

    assert alloc.allocate(SLAB + 2 * ALIGN) is None
    assert alloc.allocate(SLAB + ALIGN) == BASE


def test_free_of_a_wrong_length_or_unknown_offset_raises() -> None:
    alloc = make_allocator()
    offset = take(alloc, 100)

    with pytest.raises(RuntimeError, match=f"offset {offset} \\(length 101\\)"):
        alloc.free(offset, 101)
    alloc.free(offset, 100)
    with pytest.raises(RuntimeError, match="live length: None"):
        alloc.free(offset, 100)


def test_offsets_inside_a_slot_or_past_the_carved_ones_are_not_slots() -> None:
    alloc = make_allocator()
    first = take(alloc, ALIGN)
    run = take(alloc, SLAB + 1)

    assert alloc.length_of(first + 1) is None  # inside a slot
    assert alloc.length_of(first + ALIGN) is None  # in the slab, never carved
    assert alloc.length_of(run + ALIGN) is None  # inside a run
    assert alloc.length_of(BASE - ALIGN) is None  # before the base
    assert alloc.length_of(BASE + 100 * SLAB) is None  # past the end
    with pytest.raises(RuntimeError, match="live length: None"):
        alloc.free(run + ALIGN, SLAB + 1)


def test_a_reused_slot_reports_its_new_length() -> None:
    alloc = make_allocator()
    offsets = [take(alloc, 10), take(alloc, 20)]
    alloc.free(offsets[0], 10)

    assert take(alloc, 30) == offsets[0]
    assert [alloc.length_of(o) for o in offsets] == [30, 20]
    assert alloc.num_slots == 2

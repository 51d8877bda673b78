"""The CPU tier over a shared-memory arena."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest

from lmcache_svc.errors import InvalidArgument
from lmcache_svc.shm.arena import HEADER_BYTES, SHM_DIR, Arena, ArenaMapping
from lmcache_svc.tiers.base import SegmentInfo, Slot
from lmcache_svc.tiers.cpu import CpuTier
from tests.helpers import make_chunk, make_key

PAGE = 4096
SLAB = 16 * PAGE


@pytest.fixture
def tier() -> Iterator[CpuTier]:
    tier = CpuTier(Arena.create(8 * SLAB, slab_bytes=SLAB, prefault="off"))
    yield tier
    tier.close()


def test_put_read_size_contains_delete_round_trip(tier: CpuTier) -> None:
    k1, k2, k3 = make_key(1), make_key(2), make_key(3)
    assert tier.put(k1, make_chunk(1, 5000))
    assert tier.put(k2, memoryview(make_chunk(2, PAGE)))
    assert tier.contains_many([k1, k3, k2]) == [True, False, True]
    assert (tier.size_of(k1), tier.size_of(k3)) == (5000, None)
    out = bytearray(5000)
    assert tier.read_into(k1, memoryview(out))
    assert bytes(out) == make_chunk(1, 5000)
    assert tier.get(k2) == make_chunk(2, PAGE)
    assert not tier.read_into(k3, memoryview(bytearray(1)))
    assert (tier.num_chunks, tier.used_bytes) == (2, 2 * PAGE + PAGE)
    assert tier.delete(k1) == 2 * PAGE
    assert tier.delete(k1) == 0
    assert tier.get(k1) is None
    assert tier.stats().num_chunks == 1 and tier.stats().used_bytes == PAGE


def test_put_replaces_an_existing_key(tier: CpuTier) -> None:
    key = make_key(1)
    assert tier.put(key, make_chunk(1, 3 * PAGE))
    assert tier.put(key, make_chunk(2, PAGE))
    assert tier.get(key) == make_chunk(2, PAGE)
    assert (tier.num_chunks, tier.used_bytes) == (1, PAGE)


def test_put_replaces_even_when_full(tier: CpuTier) -> None:
    key = make_key(0)
    assert tier.put(key, make_chunk(0, tier.capacity_bytes))
    assert tier.put(key, make_chunk(1, tier.capacity_bytes))
    assert tier.get(key) == make_chunk(1, tier.capacity_bytes)


def test_read_into_a_buffer_of_the_wrong_size_raises(tier: CpuTier) -> None:
    key = make_key(1)
    tier.put(key, make_chunk(1, 100))
    with pytest.raises(InvalidArgument, match="100"):
        tier.read_into(key, memoryview(bytearray(101)))


def test_allocate_view_slot_of(tier: CpuTier) -> None:
    key = make_key(1)
    slot = tier.allocate(key, 10)
    assert slot == Slot(HEADER_BYTES, 10) == tier.slot_of(key)
    tier.view(slot)[:] = b"0123456789"
    assert tier.get(key) == b"0123456789"
    with pytest.raises(RuntimeError, match=key.hex()):
        tier.allocate(key, 10)
    assert tier.slot_of(make_key(2)) is None


def test_capacity_is_never_exceeded(tier: CpuTier) -> None:
    rng = random.Random(7)
    stored: dict[int, tuple[int, int]] = {}  # key number -> (step, nbytes) of its chunk
    for step in range(600):
        i = rng.randrange(40)
        if i in stored and rng.random() < 0.4:
            tier.delete(make_key(i))
            del stored[i]
            continue
        nbytes = rng.choice([1, PAGE, 3 * PAGE + 5, SLAB, SLAB + 1, 3 * SLAB])
        if tier.put(make_key(i), make_chunk(step, nbytes)):
            stored[i] = (step, nbytes)
        else:
            stored.pop(i, None)  # a full arena may drop the old value to make room
        assert tier.used_bytes <= tier.capacity_bytes
        assert tier.num_chunks == len(stored)
    for i, (step, nbytes) in stored.items():
        assert tier.get(make_key(i)) == make_chunk(step, nbytes)


def test_segment_is_mappable_by_a_client(tier: CpuTier) -> None:
    key = make_key(1)
    tier.put(key, b"shared bytes")
    info = tier.segment()
    assert info == SegmentInfo("shm", tier.arena.name, tier.arena.segment_size, tier.arena.nonce)
    mapping = ArenaMapping.open(info.name, info.size, info.nonce)
    assert mapping is not None
    slot = tier.slot_of(key)
    assert slot is not None
    assert bytes(mapping.view(slot.offset, slot.length)) == b"shared bytes"
    mapping.close()


def test_a_slot_being_read_is_freed_only_after_the_read(
    tier: CpuTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    k1, k2 = make_key(1), make_key(2)
    tier.put(k1, make_chunk(1, PAGE))
    real_view = tier.arena.view

    def view_after_another_thread_deletes_and_puts(slot: Slot) -> memoryview:
        monkeypatch.setattr(tier.arena, "view", real_view)
        assert tier.delete(k1) == PAGE
        assert tier.put(k2, make_chunk(2, PAGE))  # must not land in k1's slot
        return real_view(slot)

    monkeypatch.setattr(tier.arena, "view", view_after_another_thread_deletes_and_puts)
    out = bytearray(PAGE)
    assert tier.read_into(k1, memoryview(out))
    assert bytes(out) == make_chunk(1, PAGE)
    assert tier.slot_of(k2) == Slot(HEADER_BYTES + PAGE, PAGE)
    assert (tier.num_chunks, tier.used_bytes) == (1, PAGE)  # k1's slot freed after the read
    assert tier.put(k1, make_chunk(3, PAGE))
    assert tier.slot_of(k1) == Slot(HEADER_BYTES, PAGE)


def test_close_closes_the_arena() -> None:
    tier = CpuTier(Arena.create(SLAB, slab_bytes=SLAB, prefault="off"), name="cpu-test")
    assert tier.name == "cpu-test"
    path = os.path.join(SHM_DIR, tier.arena.name)
    assert os.path.exists(path)
    tier.close()
    assert not os.path.exists(path)

"""``ReadPins``: a slot dropped from the index while being read is freed by its last reader."""

from __future__ import annotations

from lmcache_svc.tiers.base import Slot
from lmcache_svc.tiers.own_slots import ReadPins


def make_pins() -> tuple[ReadPins, list[Slot]]:
    freed: list[Slot] = []
    return ReadPins(freed.append), freed


def test_a_slot_not_being_read_is_freed_when_released() -> None:
    pins, freed = make_pins()
    pins.release(Slot(0, 4096))
    assert freed == [Slot(0, 4096)]


def test_an_orphan_is_freed_by_its_last_reader_only() -> None:
    pins, freed = make_pins()
    slot, other = Slot(0, 4096), Slot(4096, 4096)
    pins.begin(slot)
    pins.begin(slot)
    pins.begin(other)
    pins.release(slot)
    assert freed == []
    pins.end(slot)
    assert freed == []
    pins.end(slot)
    assert freed == [slot]
    pins.end(other)  # never released: stays the tier's
    assert freed == [slot]


def test_a_read_that_ends_before_the_release_leaves_no_orphan() -> None:
    pins, freed = make_pins()
    slot = Slot(8192, 4096)
    pins.begin(slot)
    pins.end(slot)
    pins.release(slot)
    assert freed == [slot]
    pins.clear()
    assert freed == [slot]

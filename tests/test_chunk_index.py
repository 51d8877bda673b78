"""ChunkIndex: chunks at rest hold no state object; chunks in flux do, until they settle."""

from __future__ import annotations

import pytest

from lmcache_svc.cache.chunk_index import ChunkIndex
from lmcache_svc.keys import ChunkKey
from lmcache_svc.tiers.base import Slot


def make_key(i: int) -> ChunkKey:
    return ChunkKey(bytes([i]) * 48)


def make_index() -> tuple[ChunkIndex, dict[ChunkKey, Slot]]:
    tier: dict[ChunkKey, Slot] = {}
    return ChunkIndex(tier.get), tier


def reserve(index: ChunkIndex, tier: dict[ChunkKey, Slot], i: int) -> ChunkKey:
    key = make_key(i)
    tier[key] = Slot(4096 * (i + 1), 100 + i)
    index.reserve(key, tier[key], owner="s", deadline=1.0)
    return key


def test_commit_leaves_no_entry_and_keeps_the_slot_reachable() -> None:
    index, tier = make_index()
    key = reserve(index, tier, 1)
    entry = index.entry(key)
    assert entry is not None and not index.readable(key) and index.num_pending == 1

    index.mark_ready(key, entry)

    assert index.entry(key) is None and index.readable(key) and index.num_pending == 0
    assert index.slot_of(key) == Slot(8192, 101)


def test_pin_materializes_an_entry_and_the_last_unpin_settles_it() -> None:
    index, tier = make_index()
    key = reserve(index, tier, 1)
    index.mark_ready(key, index.entry(key))  # type: ignore[arg-type]

    index.pin(key)
    index.pin(key)
    entry = index.entry(key)
    assert entry is not None and entry.pins == 2
    assert index.least_recent_at_rest(10**9) == []  # pinned: not a victim
    entry.pins -= 2
    index.settle(key, entry)

    assert index.entry(key) is None
    assert index.least_recent_at_rest(10**9) == [(key, Slot(8192, 101))]


def test_victims_are_least_recent_first_and_cover_the_bytes_asked() -> None:
    index, tier = make_index()
    keys = [reserve(index, tier, i) for i in range(4)]
    for key in keys:
        index.mark_ready(key, index.entry(key))  # type: ignore[arg-type]
    index.touch(keys[0])
    pending = reserve(index, tier, 9)

    victims = index.least_recent_at_rest(101 + 102)

    assert [k for k, _ in victims] == [keys[1], keys[2]]
    assert [k for k, _ in index.pending()] == [pending]
    assert index.remove(keys[1]) == Slot(8192, 101) and keys[1] not in index


def test_an_indexed_chunk_without_a_tier_slot_is_a_broken_invariant() -> None:
    index, tier = make_index()
    key = reserve(index, tier, 1)
    index.mark_ready(key, index.entry(key))  # type: ignore[arg-type]
    del tier[key]
    with pytest.raises(RuntimeError, match="its tier has no slot"):
        index.slot_of(key)

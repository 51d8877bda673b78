"""ChunkIndex: chunks at rest hold no state object; chunks in flux do, until at rest again."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest

from lmcache_svc.cache.chunk_index import CHECK_LOCKS_ENV, ChunkIndex
from lmcache_svc.keys import ChunkKey
from lmcache_svc.tiers.base import Slot
from tests.helpers import make_key


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


def test_pin_materializes_an_entry_and_the_last_unpin_drops_it() -> None:
    index, tier = make_index()
    key = reserve(index, tier, 1)
    index.mark_ready(key, index.entry(key))  # type: ignore[arg-type]

    index.pin(key)
    index.pin(key)
    entry = index.entry(key)
    assert entry is not None and entry.pins == 2
    assert index.least_recent_at_rest(10**9) == []  # pinned: not a victim
    assert not index.unpin(key) and not index.unpin(key)

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


def test_a_change_without_the_lock_raises_when_checking() -> None:
    lock = threading.RLock()
    tier: dict[ChunkKey, Slot] = {}
    index = ChunkIndex(tier.get, lock, check_lock=True)
    key = make_key(1)
    tier[key] = Slot(4096, 100)

    with pytest.raises(RuntimeError, match=r"ChunkIndex\.reserve called without the cache's lock"):
        index.reserve(key, tier[key], owner="s", deadline=1.0)
    assert key not in index  # refused before it changed anything

    with lock:
        index.reserve(key, tier[key], owner="s", deadline=1.0)
        index.mark_ready(key, index.entry(key))  # type: ignore[arg-type]
        index.pin(key)
    failures: list[BaseException] = []
    with lock:  # held by this thread: another thread's change still raises
        other = threading.Thread(target=_catch(failures, lambda: index.unpin(key)))
        other.start()
        other.join()
    assert [str(e) for e in failures] == ["ChunkIndex.unpin called without the cache's lock held"]
    changes = (index.touch, index.mark_deleted, index.remove_for_demotion)
    for change in (*changes, lambda k: index.extend_deadline(k, 2.0)):
        with pytest.raises(RuntimeError, match="without the cache's lock"):
            change(key)
    assert index.entry(key) is not None and index.entry(key).pins == 1  # type: ignore[union-attr]


def _catch(failures: list[BaseException], call: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        try:
            call()
        except RuntimeError as e:
            failures.append(e)

    return run


def test_the_check_is_on_in_this_suite_and_off_without_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert os.environ.get(CHECK_LOCKS_ENV) == "1"  # set by tests/conftest.py for every test
    tier: dict[ChunkKey, Slot] = {make_key(1): Slot(4096, 100)}
    checked = ChunkIndex(tier.get, threading.RLock())
    with pytest.raises(RuntimeError, match="without the cache's lock"):
        checked.reserve(make_key(1), tier[make_key(1)], owner="s", deadline=1.0)

    monkeypatch.delenv(CHECK_LOCKS_ENV)
    unchecked = ChunkIndex(tier.get, threading.RLock())  # production default: no check
    unchecked.reserve(make_key(1), tier[make_key(1)], owner="s", deadline=1.0)
    assert unchecked.num_pending == 1

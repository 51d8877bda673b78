"""A delete that comes while a chunk is being written to (or read from) a lower tier wins:
the chunk is neither indexed nor left in the tier, so no lookup or KV event promises it.
A chunk demoted into a tier while that tier evicts it is written after the eviction's
delete, so the index and the tier agree.

The races are made deterministic by holding the tier's write, read or delete until the
other side has run (or has had the chance to)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from lmcache_svc.cache.lower_tier_manager import LowerTierManager
from lmcache_svc.cache.values import TierPolicy
from lmcache_svc.metrics import Metrics
from lmcache_svc.tiers.ssd import SsdTier
from tests.helpers import make_chunk, make_key

CHUNK = 4096


class GatedSsd(SsdTier):
    """An SSD tier whose puts wait (before writing) and reads wait (after reading) until
    ``release`` is set."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, 16 * (CHUNK + 4096))
        self.entered = threading.Event()
        self.release = threading.Event()
        self.gate_puts = self.gate_reads = self.gate_deletes = False
        self.put_done = threading.Event()

    def _wait(self) -> None:
        self.entered.set()
        assert self.release.wait(10)

    def put(self, key: Any, data: Any) -> bool:
        if self.gate_puts:
            self._wait()
        stored = super().put(key, data)
        self.put_done.set()
        return stored

    def delete(self, key: Any) -> int:
        if self.gate_deletes:
            self._wait()
        return super().delete(key)

    def read_many_into(self, items: Any) -> Any:
        results = super().read_many_into(items)
        if self.gate_reads:  # read, then held before the manager sees the result
            self._wait()
        return results


def run_during(tier: GatedSsd, fn: Any, *args: Any) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args)
    thread.start()
    assert tier.entered.wait(10), "the tier was never called"
    return thread


def test_a_delete_during_a_demotion_leaves_nothing_behind(tmp_path: Path) -> None:
    tier = GatedSsd(tmp_path / "ssd")
    lower = LowerTierManager([(tier, TierPolicy())], Metrics())
    key = make_key(1)
    since = lower.delete_count()  # the chunk left the first tier's index
    tier.gate_puts = True
    demotion = run_during(tier, lower.demote, key, memoryview(make_chunk(1, CHUNK)), 0, since)
    assert lower.delete(key) is False  # nothing indexed yet: before the fix the tier kept it
    tier.release.set()
    demotion.join(10)
    assert lower.local_tier(key) is None
    assert tier.contains_many([key]) == [False]


def test_a_delete_before_the_demotion_starts_writing_also_wins(tmp_path: Path) -> None:
    tier = GatedSsd(tmp_path / "ssd")
    lower = LowerTierManager([(tier, TierPolicy())], Metrics())
    key = make_key(2)
    since = lower.delete_count()
    lower.delete(key)  # between the eviction's choice and the write
    lower.demote(key, memoryview(make_chunk(2, CHUNK)), since=since)
    assert lower.local_tier(key) is None
    assert tier.contains_many([key]) == [False]


def test_an_undisturbed_demotion_is_indexed(tmp_path: Path) -> None:
    tier = GatedSsd(tmp_path / "ssd")
    lower = LowerTierManager([(tier, TierPolicy())], Metrics())
    lower.delete(make_key(4))  # another chunk's delete does not undo this one
    since = lower.delete_count()
    lower.delete(make_key(5))
    lower.demote(make_key(3), memoryview(make_chunk(3, CHUNK)), since=since)
    assert lower.local_tier(make_key(3)) is tier
    assert tier.contains_many([make_key(3)]) == [True]


def test_a_read_that_races_a_delete_does_not_index_the_chunk_again(tmp_path: Path) -> None:
    tier = GatedSsd(tmp_path / "ssd")
    lower = LowerTierManager([(tier, TierPolicy())], Metrics())
    key = make_key(6)
    lower.demote(key, memoryview(make_chunk(6, CHUNK)))
    (source,) = lower.sources([key])
    tier.gate_reads = True
    out = memoryview(bytearray(CHUNK))
    reader = run_during(tier, lower.read_up, [(key, source, out)])
    assert lower.delete(key) is True
    tier.release.set()
    reader.join(10)
    assert lower.local_tier(key) is None  # before the fix the read put it back in the index


def test_a_demotion_into_a_tier_evicting_the_same_chunk_waits_for_the_eviction(
    tmp_path: Path,
) -> None:
    """The chunk is in the SSD tier and (promoted) in the first tier. The SSD tier, full,
    evicts it to take another chunk; meanwhile the first tier evicts its copy and demotes it
    into the SSD tier. Before the fix that put landed between the eviction's index update
    and its delete: indexed (and announced as stored), its file deleted."""
    tier = GatedSsd(tmp_path / "ssd")
    lower = LowerTierManager([(tier, TierPolicy())], Metrics())
    key = make_key(100)
    for seed in range(100, 116):  # full: the first one is the least recently used
        lower.demote(make_key(seed), memoryview(make_chunk(seed, CHUNK)))
    tier.gate_deletes = True
    evicting = run_during(tier, lower.demote, make_key(116), memoryview(make_chunk(116, CHUNK)))
    assert lower.local_tier(key) is None  # out of the index, its delete held
    tier.put_done.clear()
    demotion = threading.Thread(target=lower.demote, args=(key, memoryview(make_chunk(100, CHUNK))))
    demotion.start()
    tier.put_done.wait(1)  # before the fix the put ran at once; now it waits
    tier.release.set()
    evicting.join(10)
    demotion.join(10)
    assert not evicting.is_alive() and not demotion.is_alive()
    assert (lower.local_tier(key) is tier, tier.contains_many([key])) == (True, [True])
    out = memoryview(bytearray(CHUNK))
    assert tier.read_into(key, out) and bytes(out) == bytes(make_chunk(100, CHUNK))


def test_a_read_that_races_an_eviction_does_not_index_the_chunk_again(tmp_path: Path) -> None:
    """A promotion reads the chunk while the full tier evicts it: the read succeeds, the
    eviction deletes the file; the read must not put the chunk back in the index."""
    tier = GatedSsd(tmp_path / "ssd")
    lower = LowerTierManager([(tier, TierPolicy())], Metrics())
    key = make_key(200)
    for seed in range(200, 216):  # full: the first one is the least recently used
        lower.demote(make_key(seed), memoryview(make_chunk(seed, CHUNK)))
    (source,) = lower.sources([key])
    tier.gate_reads = True
    out = memoryview(bytearray(CHUNK))
    reader = run_during(tier, lower.read_up, [(key, source, out)])
    lower.demote(make_key(216), memoryview(make_chunk(216, CHUNK)))  # evicts the chunk read
    assert tier.contains_many([key]) == [False]
    tier.release.set()
    reader.join(10)
    assert not reader.is_alive()
    assert lower.local_tier(key) is None  # before the fix the read put it back in the index

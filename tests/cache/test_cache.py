"""The tiered cache's policy: exact eviction, demotion and promotion order, leases, expiry."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.errors import InvalidArgument, PayloadTooLarge, SizeMismatch, UnknownNamespace
from lmcache_svc.keys import make_chunk_keys
from tests.caches import CacheFactory
from tests.helpers import make_chunk, make_hash, make_namespace

CHUNK = 64 * 1024  # bytes of one chunk in the test namespace


@pytest.fixture
def cache_factory(tmp_path: Path) -> Iterator[CacheFactory]:
    with CacheFactory(CHUNK, [make_namespace(chunk_size=256)], tmp_path) as factory:
        yield factory


NS = make_namespace(chunk_size=256).namespace_id


def put(cache: TieredCache, *names: str) -> list[str]:
    return [cache.put(NS, make_hash(n), make_chunk(n, CHUNK)) for n in names]


def where(cache: TieredCache, *names: str) -> list[str | None]:
    return [cache.contains(NS, make_hash(n)) for n in names]


def test_put_get_round_trip(cache_factory) -> None:
    cache = cache_factory()
    assert put(cache, "a") == ["reserved"]
    assert put(cache, "a") == ["already_stored"]
    data, tier = cache.get(NS, make_hash("a"))
    assert data == make_chunk("a", CHUNK) and tier == "cpu"
    assert cache.get(NS, make_hash("zz")) is None


def test_lru_eviction_order_without_lower_tier(cache_factory) -> None:
    cache = cache_factory(4)
    put(cache, "a", "b", "c", "d")
    cache.get(NS, make_hash("a"))  # a becomes most recently used
    put(cache, "e")
    assert where(cache, "a", "b", "c", "d", "e") == ["cpu", None, "cpu", "cpu", "cpu"]
    put(cache, "f")
    assert where(cache, "a", "b", "c", "d", "e", "f") == ["cpu", None, None, "cpu", "cpu", "cpu"]
    assert cache.metrics.evictions.labels(tier="cpu")._value.get() == 2


def test_a_touch_keeps_a_chunk_read_in_place_recent_and_counts_its_read(cache_factory) -> None:
    """A client that read chunks without a lease reports them (``TouchChunks``): they become
    the most recently used, as a lease would make them, and their bytes count as read."""
    cache = cache_factory(4)
    put(cache, "a", "b", "c", "d")
    read = cache.metrics.bytes_read.labels(tier="cpu")
    before = read._value.get()
    assert cache.touch(NS, [make_hash("a"), make_hash("zz")]) == 1  # zz: not held
    assert read._value.get() - before == CHUNK
    put(cache, "e")
    assert where(cache, "a", "b", "c", "d", "e") == ["cpu", None, "cpu", "cpu", "cpu"]
    with pytest.raises(InvalidArgument):
        cache.touch(NS, [b"short"])


def test_eviction_demotes_to_ssd_and_load_promotes_back(cache_factory) -> None:
    cache = cache_factory(4, ssd_chunks=8)
    put(cache, "a", "b", "c", "d", "e")
    assert where(cache, "a", "b", "c", "d", "e") == ["ssd", "cpu", "cpu", "cpu", "cpu"]
    lease = cache.prepare_load(NS, [make_hash("a")])
    assert lease.source_tiers == ["ssd"]
    assert bytes(cache.view(lease.slots[0])) == make_chunk("a", CHUNK)
    cache.release_load(lease.lease_id)
    # promoting a evicted b (the least recently used) down to the SSD; a stays on SSD too
    assert where(cache, "a", "b") == ["cpu", "ssd"]
    assert cache.tiers[1].size_of(cache._core.namespaces.keys(NS, [make_hash("a")])[0]) == CHUNK
    assert cache.metrics.promotions.labels(tier="cpu")._value.get() == 1
    assert cache.metrics.demotions.labels(tier="ssd")._value.get() == 2


def test_ssd_evicts_its_own_lru_when_full(cache_factory) -> None:
    cache = cache_factory(2, ssd_chunks=2)
    put(cache, "a", "b", "c", "d", "e")  # a, b, c demoted in that order; ssd holds 2
    assert where(cache, "a", "b", "c", "d", "e") == [None, "ssd", "ssd", "cpu", "cpu"]
    assert cache.tiers[1].used_bytes <= cache.tiers[1].capacity_bytes


def test_lookup_returns_contiguous_prefix_and_tiers(cache_factory) -> None:
    cache = cache_factory(4, ssd_chunks=8)
    put(cache, "a", "b", "c", "d", "e", "g")  # a, b on ssd
    hashes = [make_hash(n) for n in ("a", "b", "c", "f", "g")]
    result = cache.lookup(NS, hashes)
    assert result.num_hit_chunks == 3 and result.tiers == ["ssd", "ssd", "cpu"]
    assert cache.lookup(NS, [make_hash("f")]).num_hit_chunks == 0


def test_pinned_chunks_are_never_evicted(cache_factory) -> None:
    cache = cache_factory(4)
    put(cache, "a", "b", "c", "d")
    lease = cache.prepare_load(NS, [make_hash(n) for n in "abcd"])
    assert len(lease.slots) == 4
    assert put(cache, "e") == ["no_space"]
    assert where(cache, "a", "b", "c", "d") == ["cpu"] * 4
    assert cache.release_load(lease.lease_id)
    assert not cache.release_load(lease.lease_id)
    assert put(cache, "e") == ["reserved"]


def test_prepare_load_leases_only_the_available_prefix(cache_factory) -> None:
    cache = cache_factory(4)
    put(cache, "a", "c")
    lease = cache.prepare_load(NS, [make_hash(n) for n in "abc"])
    assert len(lease.slots) == 1 and cache.stats().active_leases == 1
    assert cache.prepare_load(NS, [make_hash("b")]).lease_id is None


def test_reservations_expire_and_late_commits_do_nothing(cache_factory) -> None:
    cache = cache_factory(
        2, settings=CacheSettings(max_reserved_fraction=1.0, max_tenant_reserved_fraction=1.0)
    )
    prepared = cache.prepare_store(NS, [make_hash("a"), make_hash("b")], session_id="s1", ttl_s=1)
    assert [p.status for p in prepared] == ["reserved", "reserved"]
    assert cache.prepare_store(NS, [make_hash("a")])[0].status == "in_progress"
    assert put(cache, "c") == ["no_space"]  # reserved slots are not evictable
    assert cache.reap_expired(now=float("inf")) == 2
    # expired, not pending any more, but quarantined: s1 may still be writing into them
    assert cache.stats().pending_stores == 0 and cache.tiers[0].used_bytes == 2 * CHUNK
    assert cache.commit_store(NS, [make_hash("a")], session_id="s1") == 0
    assert where(cache, "a") == [None] and cache.tiers[0].used_bytes == CHUNK
    assert cache.abort_store(NS, [make_hash("b")], session_id="s1") == 1
    assert cache.tiers[0].used_bytes == 0


def test_commit_needs_the_owning_session(cache_factory) -> None:
    cache = cache_factory(2)
    (slot,) = cache.prepare_store(NS, [make_hash("a")], session_id="s1")
    cache.view(slot.slot)[:] = make_chunk("a", CHUNK)
    assert cache.commit_store(NS, [make_hash("a")], session_id="s2") == 0
    assert cache.commit_store(NS, [make_hash("a")], session_id="s1") == 1
    assert cache.get(NS, make_hash("a"))[0] == make_chunk("a", CHUNK)


def test_closing_a_session_reclaims_its_reservations_and_leases(cache_factory) -> None:
    cache = cache_factory(4)
    put(cache, "a")
    sid = cache.open_session()
    cache.prepare_store(NS, [make_hash("b"), make_hash("c")], session_id=sid)
    lease = cache.prepare_load(NS, [make_hash("a")], session_id=sid)
    assert lease.lease_id and cache.stats().pending_stores == 2
    cache.close_session(sid)
    stats = cache.stats()
    assert stats.pending_stores == 0 and stats.active_leases == 0
    assert cache.tiers[0].used_bytes == CHUNK  # only a is left
    assert not cache.has_session(sid)


def test_delete_of_a_pinned_chunk_frees_it_on_release(cache_factory) -> None:
    cache = cache_factory(4, ssd_chunks=4)
    put(cache, "a")
    lease = cache.prepare_load(NS, [make_hash("a")])
    assert cache.delete(NS, [make_hash("a")]) == 1
    assert where(cache, "a") == [None]
    assert bytes(cache.view(lease.slots[0])) == make_chunk("a", CHUNK)  # still readable
    assert cache.tiers[0].used_bytes == CHUNK
    cache.release_load(lease.lease_id)
    assert cache.tiers[0].used_bytes == 0
    assert cache.delete(NS, [make_hash("a")]) == 0


def test_write_through_copies_committed_chunks_in_the_background(cache_factory) -> None:
    cache = cache_factory(4, ssd_chunks=8, write_through=True)
    cache.start()
    put(cache, "a", "b")
    assert cache.flush(10)
    ssd = cache.tiers[1]
    keys = cache._core.namespaces.keys(NS, [make_hash("a"), make_hash("b")])
    assert ssd.contains_many(keys) == [True, True]
    assert ssd.get(keys[0]) == make_chunk("a", CHUNK)
    # an evicted chunk already on the SSD is not written again
    written = cache.metrics.bytes_written.labels(tier="ssd")._value.get()
    put(cache, "c", "d", "e")
    assert cache.flush(10)
    assert where(cache, "a") == ["ssd"]
    assert cache.metrics.bytes_written.labels(tier="ssd")._value.get() == written + 3 * CHUNK


def test_watermark_eviction(cache_factory) -> None:
    cache = cache_factory(10, settings=CacheSettings(high_watermark=0.8, low_watermark=0.5))
    put(cache, *"abcdefgh")
    assert cache.evict_to_watermark() == 0  # 80% is not above the high watermark
    put(cache, "i")
    assert cache.evict_to_watermark() == 4
    assert where(cache, *"abcdefghi") == [None] * 4 + ["cpu"] * 5


def test_bad_input_is_rejected_with_clear_errors(cache_factory) -> None:
    cache = cache_factory(2)
    with pytest.raises(SizeMismatch, match=str(CHUNK)):
        cache.put(NS, make_hash("a"), b"x" * 10)
    with pytest.raises(UnknownNamespace, match="not registered"):
        cache.lookup(make_namespace(tenant="other", chunk_size=256).namespace_id, [make_hash("a")])
    with pytest.raises(InvalidArgument, match="32 bytes"):
        cache.lookup(NS, [b"short"])
    with pytest.raises(InvalidArgument, match="namespace id"):
        cache.lookup(b"abc", [make_hash("a")])
    with pytest.raises(PayloadTooLarge):
        cache.lookup(NS, [make_hash(str(i)) for i in range(9000)])
    with pytest.raises(InvalidArgument, match="ttl"):
        cache.prepare_store(NS, [make_hash("a")], ttl_s=-1)
    assert cache.stats().pending_stores == 0


def test_bad_lease_ttl_leaves_no_pin_behind(cache_factory) -> None:
    cache = cache_factory(2)
    put(cache, "a")
    put(cache, "b")
    with pytest.raises(InvalidArgument, match="ttl"):
        cache.prepare_load(NS, [make_hash("a"), make_hash("b")], ttl_s=-1)
    assert cache.stats().active_leases == 0
    put(cache, "c")  # a full first tier: one of a and b must be evictable to make room
    assert cache.lookup(NS, [make_hash("c")]).num_hit_chunks == 1


def test_namespaces_isolate_chunks(cache_factory) -> None:
    cache = cache_factory(4)
    other = cache.register_namespace(make_namespace(tenant="tenant-b", chunk_size=256)).namespace_id
    put(cache, "a")
    assert cache.lookup(other, [make_hash("a")]).num_hit_chunks == 0
    assert cache.get(other, make_hash("a")) is None


def test_concurrent_clients_never_exceed_capacity_or_mix_bytes(cache_factory) -> None:
    # one tenant's uploads may reserve the whole (tiny) arena: this is about capacity
    cache = cache_factory(6, ssd_chunks=10, settings=CacheSettings(max_tenant_reserved_fraction=1))
    cpu, ssd = cache.tiers
    names = [f"c{i}" for i in range(40)]
    errors: list[BaseException] = []
    over: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if cpu.used_bytes > cpu.capacity_bytes or ssd.used_bytes > ssd.capacity_bytes:
                over.append(f"cpu={cpu.used_bytes} ssd={ssd.used_bytes}")

    def client(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                run = rng.sample(names, 3)
                if rng.random() < 0.5:
                    put(cache, *run)
                    continue
                lease = cache.prepare_load(NS, [make_hash(n) for n in run])
                for n, slot in zip(run, lease.slots):
                    assert bytes(cache.view(slot)) == make_chunk(n, CHUNK), n
                if lease.lease_id:
                    cache.release_load(lease.lease_id)
        except BaseException as e:
            errors.append(e)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert not errors, errors[0]
    assert not over, over[:3]
    stats = cache.stats()
    assert stats.active_leases == 0 and stats.pending_stores == 0


def test_the_cache_index_refuses_changes_outside_the_cache_lock_in_this_suite(
    cache_factory,
) -> None:
    """Every cache test runs with the chunk index's lock check on (tests/conftest.py): a
    change made without the cache's lock raises instead of racing."""
    cache = cache_factory()
    put(cache, "a")
    key = make_chunk_keys(NS, [make_hash("a")])[0]
    with pytest.raises(RuntimeError, match=r"ChunkIndex\.pin called without the cache's lock"):
        cache._core.slots.pin_prefix([key])
    with cache._core.lock:
        assert cache._core.slots.pin_prefix([key]) == [key]
        cache._core.slots.unpin(key)
        assert cache._core.slots.entry(key) is None  # at rest again

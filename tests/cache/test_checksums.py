"""Arena chunks carry an xxh3-64 checksum taken after commit: a chunk whose bytes changed
afterwards (a stray write, a bad page) is never demoted, written through or handed to a load
that asks ``verify``; it is dropped and counted."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.cache.values import TierPolicy
from lmcache_svc.client import CacheClient
from lmcache_svc.keys import KVLayout, Namespace
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.cpu import CpuTier
from lmcache_svc.tiers.ssd import SsdTier
from tests.helpers import wait_until
from tests.server.inprocess import serve as serve  # the fixture

LAYOUT = KVLayout(
    "uint8", num_layers=1, num_kv_heads=1, head_size=128, block_size=16, page_layout="test"
)
NS = Namespace(model="m", layout=LAYOUT, chunk_size=256)
CHUNK = NS.chunk_bytes
NS_ID = NS.namespace_id


def h(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def chunk(name: str) -> bytes:
    seed = hashlib.sha256(b"data" + name.encode()).digest()
    return (seed * (CHUNK // len(seed) + 1))[:CHUNK]


def corrupt(cache: TieredCache, name: str) -> None:
    """Flip one byte of a committed chunk in the arena (what a stray writer would do)."""
    lease = cache.prepare_load(NS_ID, [h(name)])
    view = cache.view(lease.slots[0])
    view[100] ^= 0xFF
    del view
    cache.release_load(lease.lease_id)


def num_corrupted(cache: TieredCache) -> float:
    return cache.metrics.tier_errors.labels(tier="cpu", kind="corrupted")._value.get()


@pytest.fixture
def make_cache(tmp_path: Path) -> Iterator:
    made: list[TieredCache] = []

    def make(
        num_chunks: int,
        ssd_chunks: int | None = None,
        write_through: bool = False,
        **settings: object,
    ) -> TieredCache:
        arena = Arena.create(num_chunks * CHUNK, slab_bytes=CHUNK, prefault="off")
        lower = []
        if ssd_chunks is not None:
            ssd = SsdTier(tmp_path / f"ssd{len(made)}", ssd_chunks * (CHUNK + 4096))
            lower.append((ssd, TierPolicy(accept_demotions=True, write_through=write_through)))
        settings.setdefault("high_watermark", 1.0)
        cache = TieredCache(CpuTier(arena), lower, settings=CacheSettings(**settings))
        cache.register_namespace(NS)
        cache.start()  # the background checksum thread
        made.append(cache)
        return cache

    yield make
    for cache in made:
        cache.close()


def put(cache: TieredCache, *names: str) -> None:
    for name in names:
        assert cache.put(NS_ID, h(name), chunk(name)) == "reserved"
    assert cache.flush()  # checksums taken


def test_verified_get_refuses_a_corrupted_chunk(make_cache) -> None:
    cache = make_cache(4)
    put(cache, "a", "b")
    corrupt(cache, "a")
    assert cache.get(NS_ID, h("a"))[0] != chunk("a")  # unverified: the changed bytes
    assert cache.get(NS_ID, h("a"), verify=True) is None
    assert cache.lookup(NS_ID, [h("a")]).num_hit_chunks == 0  # dropped
    assert num_corrupted(cache) == 1
    assert cache.get(NS_ID, h("b"), verify=True)[0] == chunk("b")
    assert cache.tiers[0].used_bytes == CHUNK


def test_verified_load_leases_only_the_intact_prefix(make_cache) -> None:
    cache = make_cache(4)
    put(cache, "a", "b", "c")
    corrupt(cache, "b")
    lease = cache.prepare_load(NS_ID, [h("a"), h("b"), h("c")], verify=True)
    assert len(lease.slots) == 1 and bytes(cache.view(lease.slots[0])) == chunk("a")
    cache.release_load(lease.lease_id)
    assert cache.lookup(NS_ID, [h("b"), h("c")]).num_hit_chunks == 0
    assert cache.lookup(NS_ID, [h("c")]).num_hit_chunks == 1  # c is intact and stays


def test_a_corrupted_chunk_is_never_demoted(make_cache) -> None:
    cache = make_cache(2, ssd_chunks=4)
    put(cache, "a", "b")
    corrupt(cache, "a")
    assert cache.get(NS_ID, h("b")) is not None  # b used last
    put(cache, "c")  # evicts a (least recently used)
    assert cache.lookup(NS_ID, [h("a")]).num_hit_chunks == 0  # not on the SSD either
    assert num_corrupted(cache) == 1
    put(cache, "d")  # evicts b, intact: demoted
    assert num_corrupted(cache) == 1
    assert cache.lookup(NS_ID, [h("b")]).tiers == ["ssd"]
    assert cache.get(NS_ID, h("b"), verify=True)[0] == chunk("b")


def test_a_corrupted_chunk_is_never_written_through(make_cache) -> None:
    cache = make_cache(4, ssd_chunks=4, write_through=True)
    lower = cache.tiers[1]
    (prepared,) = cache.prepare_store(NS_ID, [h("a")], session_id="s")
    view = cache.view(prepared.slot)
    view[:] = chunk("a")
    cache._checksummer.stop()  # take the checksum before the write-through runs
    cache._write_through.stop()
    assert cache.commit_store(NS_ID, [h("a")], session_id="s") == 1
    cache._first_tier.record_checksums(cache._keys(NS_ID, [h("a")]))
    view[7] ^= 0x01  # the writer keeps writing after its commit
    cache._first_tier.copy_through(cache._keys(NS_ID, [h("a")]))
    assert lower.num_chunks == 0 and num_corrupted(cache) == 1
    assert cache.get(NS_ID, h("a")) is None  # dropped from the arena too


def test_client_load_and_get_with_verify(serve) -> None:
    srv = serve(4)
    srv.cache.register_namespace(NS)
    with CacheClient(srv.socket) as client:
        assert client.store(NS_ID, [h("a"), h("b")], [chunk("a"), chunk("b")]) == 2
        assert srv.cache.flush()
        corrupt(srv.cache, "b")
        assert client.load(NS_ID, [h("a"), h("b")], verify=True) == [chunk("a")]
        assert client.get(NS_ID, [h("a"), h("b")], verify=True) == [chunk("a"), None]


def test_checksums_can_be_turned_off(make_cache) -> None:
    cache = make_cache(4, checksums=False)
    put(cache, "a")
    corrupt(cache, "a")
    assert cache.get(NS_ID, h("a"), verify=True)[0] != chunk("a")


def test_paced_checksums_are_all_taken_without_a_flush(make_cache) -> None:
    """Commits keep coming (never quiet for a minute), yet every chunk gets its checksum
    once it has waited ``checksum_max_delay_s``: a later corruption is caught."""
    cache = make_cache(8, checksum_quiet_s=60, checksum_max_delay_s=0.2)
    names = [f"c{i}" for i in range(6)]
    for name in names:
        assert cache.put(NS_ID, h(name), chunk(name)) == "reserved"
        time.sleep(0.05)  # the behaviour under test: commits keep coming, never quiet
    wait_until(lambda: not cache._checksummer._num_pending, 10, "every checksum taken")
    for name in names:
        corrupt(cache, name)
        assert cache.get(NS_ID, h(name), verify=True) is None
    assert num_corrupted(cache) == len(names)


def test_a_write_through_takes_the_checksum_the_pace_has_not_yet(make_cache) -> None:
    cache = make_cache(4, ssd_chunks=4, write_through=True, checksum_quiet_s=60,
                       checksum_max_delay_s=60)  # fmt: skip
    assert cache.put(NS_ID, h("a"), chunk("a")) == "reserved"
    assert cache._write_through.flush(10)  # the paced checksum is still waiting
    assert cache._checksummer._num_pending == 1
    corrupt(cache, "a")
    assert cache.get(NS_ID, h("a"), verify=True) is None  # dropped from the arena ...
    assert num_corrupted(cache) == 1
    assert cache.get(NS_ID, h("a"), verify=True)[0] == chunk("a")  # ... the SSD copy is good

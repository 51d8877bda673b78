"""Arena chunks carry an xxh3-64 checksum taken after commit: a chunk whose bytes changed
afterwards (a stray write, a bad page) is never demoted, written through or handed to a load
that asks ``verify``; it is dropped and counted."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_svc.cache import TieredCache
from lmcache_svc.client import CacheClient
from tests.caches import CacheFactory
from tests.helpers import make_chunk, make_hash, make_namespace, wait_until
from tests.server.inprocess import serve as serve  # the fixture

NS = make_namespace(chunk_size=256)  # 64 KiB chunks
CHUNK = NS.chunk_bytes
NS_ID = NS.namespace_id


def chunk(name: str) -> bytes:
    return make_chunk(name, CHUNK)


def corrupt(cache: TieredCache, name: str) -> None:
    """Flip one byte of a committed chunk in the arena (what a stray writer would do)."""
    lease = cache.prepare_load(NS_ID, [make_hash(name)])
    view = cache.view(lease.slots[0])
    view[100] ^= 0xFF
    del view
    cache.release_load(lease.lease_id)


def num_corrupted(cache: TieredCache) -> float:
    return cache.metrics.tier_errors.labels(tier="cpu", kind="corrupted")._value.get()


@pytest.fixture
def make_cache(tmp_path: Path) -> Iterator[CacheFactory]:
    # started: the background checksum thread
    with CacheFactory(CHUNK, [NS], tmp_path, start=True, high_watermark=1.0) as factory:
        yield factory


def put(cache: TieredCache, *names: str) -> None:
    for name in names:
        assert cache.put(NS_ID, make_hash(name), chunk(name)) == "reserved"
    assert cache.flush()  # checksums taken


def test_verified_get_refuses_a_corrupted_chunk(make_cache) -> None:
    cache = make_cache(4)
    put(cache, "a", "b")
    corrupt(cache, "a")
    assert cache.get(NS_ID, make_hash("a"))[0] != chunk("a")  # unverified: the changed bytes
    assert cache.get(NS_ID, make_hash("a"), verify=True) is None
    assert cache.lookup(NS_ID, [make_hash("a")]).num_hit_chunks == 0  # dropped
    assert num_corrupted(cache) == 1
    assert cache.get(NS_ID, make_hash("b"), verify=True)[0] == chunk("b")
    assert cache.tiers[0].used_bytes == CHUNK


def test_verified_load_leases_only_the_intact_prefix(make_cache) -> None:
    cache = make_cache(4)
    put(cache, "a", "b", "c")
    corrupt(cache, "b")
    lease = cache.prepare_load(NS_ID, [make_hash("a"), make_hash("b"), make_hash("c")], verify=True)
    assert len(lease.slots) == 1 and bytes(cache.view(lease.slots[0])) == chunk("a")
    cache.release_load(lease.lease_id)
    assert cache.lookup(NS_ID, [make_hash("b"), make_hash("c")]).num_hit_chunks == 0
    assert cache.lookup(NS_ID, [make_hash("c")]).num_hit_chunks == 1  # c is intact and stays


def test_a_corrupted_chunk_is_never_demoted(make_cache) -> None:
    cache = make_cache(2, ssd_chunks=4)
    put(cache, "a", "b")
    corrupt(cache, "a")
    assert cache.get(NS_ID, make_hash("b")) is not None  # b used last
    put(cache, "c")  # evicts a (least recently used)
    assert cache.lookup(NS_ID, [make_hash("a")]).num_hit_chunks == 0  # not on the SSD either
    assert num_corrupted(cache) == 1
    put(cache, "d")  # evicts b, intact: demoted
    assert num_corrupted(cache) == 1
    assert cache.lookup(NS_ID, [make_hash("b")]).tiers == ["ssd"]
    assert cache.get(NS_ID, make_hash("b"), verify=True)[0] == chunk("b")


def test_a_corrupted_chunk_is_never_written_through(make_cache) -> None:
    cache = make_cache(4, ssd_chunks=4, write_through=True)
    lower = cache.tiers[1]
    (prepared,) = cache.prepare_store(NS_ID, [make_hash("a")], session_id="s")
    view = cache.view(prepared.slot)
    view[:] = chunk("a")
    cache._core.checksummer.stop()  # take the checksum before the write-through runs
    cache._core.write_through.stop()
    assert cache.commit_store(NS_ID, [make_hash("a")], session_id="s") == 1
    cache._core.moves.record_checksums(cache._core.namespaces.keys(NS_ID, [make_hash("a")]))
    view[7] ^= 0x01  # the writer keeps writing after its commit
    cache._core.moves.copy_through(cache._core.namespaces.keys(NS_ID, [make_hash("a")]))
    assert lower.num_chunks == 0 and num_corrupted(cache) == 1
    assert cache.get(NS_ID, make_hash("a")) is None  # dropped from the arena too


def test_client_load_and_get_with_verify(serve) -> None:
    srv = serve(4)
    srv.cache.register_namespace(NS)
    with CacheClient(srv.socket) as client:
        assert client.store(NS_ID, [make_hash("a"), make_hash("b")], [chunk("a"), chunk("b")]) == 2
        assert srv.cache.flush()
        corrupt(srv.cache, "b")
        assert client.load(NS_ID, [make_hash("a"), make_hash("b")], verify=True) == [chunk("a")]
        assert client.get(NS_ID, [make_hash("a"), make_hash("b")], verify=True) == [
            chunk("a"),
            None,
        ]


def test_checksums_can_be_turned_off(make_cache) -> None:
    cache = make_cache(4, checksums=False)
    put(cache, "a")
    corrupt(cache, "a")
    assert cache.get(NS_ID, make_hash("a"), verify=True)[0] != chunk("a")


def test_paced_checksums_are_all_taken_without_a_flush(make_cache) -> None:
    """Commits keep coming (never quiet for a minute), yet every chunk gets its checksum
    once it has waited ``checksum_max_delay_s``: a later corruption is caught."""
    cache = make_cache(8, checksum_quiet_s=60, checksum_max_delay_s=0.2)
    names = [f"c{i}" for i in range(6)]
    for name in names:
        assert cache.put(NS_ID, make_hash(name), chunk(name)) == "reserved"
        time.sleep(0.05)  # the behaviour under test: commits keep coming, never quiet
    wait_until(lambda: not cache._core.checksummer._num_pending, 10, "every checksum taken")
    for name in names:
        corrupt(cache, name)
        assert cache.get(NS_ID, make_hash(name), verify=True) is None
    assert num_corrupted(cache) == len(names)


def test_a_write_through_takes_the_checksum_the_pace_has_not_yet(make_cache) -> None:
    cache = make_cache(4, ssd_chunks=4, write_through=True, checksum_quiet_s=60,
                       checksum_max_delay_s=60)  # fmt: skip
    assert cache.put(NS_ID, make_hash("a"), chunk("a")) == "reserved"
    assert cache._core.write_through.flush(10)  # the paced checksum is still waiting
    assert cache._core.checksummer._num_pending == 1
    corrupt(cache, "a")
    assert cache.get(NS_ID, make_hash("a"), verify=True) is None  # dropped from the arena ...
    assert num_corrupted(cache) == 1
    assert cache.get(NS_ID, make_hash("a"), verify=True)[0] == chunk(
        "a"
    )  # ... the SSD copy is good

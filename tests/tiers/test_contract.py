"""One contract suite, run against every tier: what the cache relies on from any medium."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_svc.arena import Arena
from lmcache_svc.errors import InvalidArgument
from lmcache_svc.keys import ChunkKey
from lmcache_svc.tiers.base import SlotTier, Tier
from lmcache_svc.tiers.cpu import CpuTier
from lmcache_svc.tiers.ssd import SsdTier

CHUNK = 16 * 1024
CAPACITY_CHUNKS = 8


def make_key(i: int) -> ChunkKey:
    return ChunkKey(bytes([i % 256]) * 16 + i.to_bytes(32, "little"))


def make_chunk(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(256)) * (CHUNK // 256)


def _cpu(tmp_path: Path, request: pytest.FixtureRequest) -> Tier:
    return CpuTier(Arena.create(CAPACITY_CHUNKS * CHUNK, slab_bytes=CHUNK, prefault="off"))


def _ssd(tmp_path: Path, request: pytest.FixtureRequest) -> Tier:
    # capacity counts whole files: a 4 KiB header plus the payload
    return SsdTier(tmp_path / "ssd", CAPACITY_CHUNKS * (CHUNK + 4096))


def _redis(tmp_path: Path, request: pytest.FixtureRequest) -> Tier:
    from lmcache_svc.tiers.redis import RedisTier

    server = request.getfixturevalue("redis_server")
    prefix = f"contract:{request.node.name}:"
    return RedisTier(server.url, CAPACITY_CHUNKS * (CHUNK + 128), key_prefix=prefix)


def _redis_cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Tier:
    from lmcache_svc.tiers.redis import RedisTier

    cluster = request.getfixturevalue("redis_cluster")
    prefix = f"contract:{request.node.name}:"
    return RedisTier(cluster.url, CAPACITY_CHUNKS * (CHUNK + 128), cluster=True, key_prefix=prefix)


FACTORIES = {"cpu": _cpu, "ssd": _ssd, "redis": _redis, "redis_cluster": _redis_cluster}


@pytest.fixture(params=sorted(FACTORIES))
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    made = FACTORIES[request.param](tmp_path, request)
    yield made
    made.close()


def test_round_trip(tier: Tier) -> None:
    assert tier.put(make_key(1), make_chunk(1))
    out = bytearray(CHUNK)
    assert tier.read_into(make_key(1), memoryview(out))
    assert bytes(out) == make_chunk(1)
    assert tier.get(make_key(1)) == make_chunk(1)
    assert tier.size_of(make_key(1)) == CHUNK
    assert tier.num_chunks == 1 and tier.used_bytes >= CHUNK


def test_missing_chunks(tier: Tier) -> None:
    assert tier.get(make_key(9)) is None
    assert tier.size_of(make_key(9)) is None
    assert not tier.read_into(make_key(9), memoryview(bytearray(CHUNK)))
    assert tier.delete(make_key(9)) == 0


def test_overwrite_replaces_and_delete_frees(tier: Tier) -> None:
    tier.put(make_key(1), make_chunk(1))
    used = tier.used_bytes
    assert tier.put(make_key(1), make_chunk(2))
    assert tier.get(make_key(1)) == make_chunk(2)
    assert tier.used_bytes == used and tier.num_chunks == 1
    assert tier.delete(make_key(1)) > 0
    assert tier.used_bytes == 0 and tier.num_chunks == 0
    assert tier.get(make_key(1)) is None


def test_contains_many_keeps_order(tier: Tier) -> None:
    for i in (0, 2, 3):
        tier.put(make_key(i), make_chunk(i))
    assert tier.contains_many([make_key(i) for i in range(5)]) == [True, False, True, True, False]
    assert tier.contains_many([]) == []


def test_batches(tier: Tier) -> None:
    items = [(make_key(i), make_chunk(i)) for i in range(4)]
    assert tier.put_many(items) == [True] * 4
    outs = [memoryview(bytearray(CHUNK)) for _ in range(5)]
    got = tier.read_many_into([(make_key(i), outs[i]) for i in range(5)])
    assert got == [True, True, True, True, False]
    assert [bytes(o) for o in outs[:4]] == [make_chunk(i) for i in range(4)]


def test_capacity_is_never_exceeded(tier: Tier) -> None:
    results = [tier.put(make_key(i), make_chunk(i)) for i in range(CAPACITY_CHUNKS + 3)]
    assert results[:CAPACITY_CHUNKS] == [True] * CAPACITY_CHUNKS
    assert results[CAPACITY_CHUNKS:] == [False] * 3
    assert tier.used_bytes <= tier.capacity_bytes
    assert tier.get(make_key(CAPACITY_CHUNKS)) is None  # a refused put wrote nothing


def test_capacity_under_concurrent_puts(tier: Tier) -> None:
    def put_range(start: int) -> None:
        for i in range(start, start + 6):
            tier.put(make_key(i), make_chunk(i))

    threads = [threading.Thread(target=put_range, args=(k * 6,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tier.num_chunks == CAPACITY_CHUNKS
    assert tier.used_bytes <= tier.capacity_bytes


def test_wrong_output_size_is_an_error(tier: Tier) -> None:
    tier.put(make_key(1), make_chunk(1))
    with pytest.raises(InvalidArgument):
        tier.read_into(make_key(1), memoryview(bytearray(CHUNK - 1)))


def test_stats_and_slot_capability(tier: Tier) -> None:
    tier.put(make_key(1), make_chunk(1))
    stats = tier.stats()
    assert stats.name == tier.name and stats.num_chunks == 1
    assert stats.capacity_bytes == tier.capacity_bytes
    if isinstance(tier, SlotTier):
        slot = tier.slot_of(make_key(1))
        assert slot is not None and bytes(tier.view(slot)) == make_chunk(1)
        assert tier.segment().transport == "shm"

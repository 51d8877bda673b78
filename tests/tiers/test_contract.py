"""One contract suite, run against every tier: what the cache relies on from any medium."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lmcache_svc.errors import Corrupted, InvalidArgument, TierError
from lmcache_svc.keys import ChunkKey
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.base import MEDIA, ChunkDescription, Failed, SlotTier, Tier
from lmcache_svc.tiers.cpu import CpuTier
from lmcache_svc.tiers.ssd import SsdTier
from tests.helpers import make_chunk, make_key

CHUNK = 16 * 1024
CAPACITY_CHUNKS = 8


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


def _hbm(tmp_path: Path, request: pytest.FixtureRequest) -> Tier:
    # the HBM tier over a CPU tensor (its allocator seam): all of it but the device copies
    torch = pytest.importorskip("torch", reason="the HBM tier needs torch (the [torch] extra)")
    from lmcache_svc.tiers.hbm import DevicePool, HbmTier

    pool = DevicePool(torch.zeros(CAPACITY_CHUNKS * CHUNK, dtype=torch.uint8))
    return HbmTier(pool, slab_bytes=CHUNK)


FACTORIES = {
    "cpu": _cpu,
    "ssd": _ssd,
    "redis": _redis,
    "redis_cluster": _redis_cluster,
    "hbm": _hbm,
}


@pytest.fixture(params=sorted(FACTORIES))
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    made = FACTORIES[request.param](tmp_path, request)
    yield made
    made.close()


def test_described_values_read_back_the_same(tier: Tier) -> None:
    """With ``describe`` set (KV events on), values read back byte for byte at the same
    size, and a tier that persists (SSD, Redis) gives each description back from its
    headers; others give none."""
    desc = ChunkDescription(bytes(range(32)), bytes(range(256)) * 4)
    tier.describe = {make_key(1): desc, make_key(2): desc}.get
    assert tier.put(make_key(1), make_chunk(1, CHUNK))
    items = [(make_key(i), make_chunk(i, CHUNK)) for i in (2, 3)]
    assert tier.put_many(items) == [True, True]
    for i in (1, 2, 3):
        assert tier.size_of(make_key(i)) == CHUNK
        out = bytearray(CHUNK)
        assert tier.read_into(make_key(i), memoryview(out)) and bytes(out) == make_chunk(i, CHUNK)
    keys = [make_key(i) for i in (1, 2, 3, 4)]
    persists = tier.medium in ("disk", "remote")
    expected = [desc, desc, None, None] if persists else [None] * 4
    assert tier.describe_many(keys) == expected


def test_round_trip(tier: Tier) -> None:
    assert tier.put(make_key(1), make_chunk(1, CHUNK))
    out = bytearray(CHUNK)
    assert tier.read_into(make_key(1), memoryview(out))
    assert bytes(out) == make_chunk(1, CHUNK)
    assert tier.get(make_key(1)) == make_chunk(1, CHUNK)
    assert tier.size_of(make_key(1)) == CHUNK
    assert tier.num_chunks == 1 and tier.used_bytes >= CHUNK


def test_missing_chunks(tier: Tier) -> None:
    assert tier.get(make_key(9)) is None
    assert tier.size_of(make_key(9)) is None
    assert not tier.read_into(make_key(9), memoryview(bytearray(CHUNK)))
    assert tier.delete(make_key(9)) == 0


def test_overwrite_replaces_and_delete_frees(tier: Tier) -> None:
    tier.put(make_key(1), make_chunk(1, CHUNK))
    used = tier.used_bytes
    assert tier.put(make_key(1), make_chunk(2, CHUNK))
    assert tier.get(make_key(1)) == make_chunk(2, CHUNK)
    assert tier.used_bytes == used and tier.num_chunks == 1
    assert tier.delete(make_key(1)) > 0
    assert tier.used_bytes == 0 and tier.num_chunks == 0
    assert tier.get(make_key(1)) is None


def test_contains_many_keeps_order(tier: Tier) -> None:
    for i in (0, 2, 3):
        tier.put(make_key(i), make_chunk(i, CHUNK))
    assert tier.contains_many([make_key(i) for i in range(5)]) == [True, False, True, True, False]
    assert tier.contains_many([]) == []


def test_batches(tier: Tier) -> None:
    items = [(make_key(i), make_chunk(i, CHUNK)) for i in range(4)]
    assert tier.put_many(items) == [True] * 4
    outs = [memoryview(bytearray(CHUNK)) for _ in range(5)]
    got = tier.read_many_into([(make_key(i), outs[i]) for i in range(5)])
    assert got == [True, True, True, True, False]
    assert [bytes(o) for o in outs[:4]] == [make_chunk(i, CHUNK) for i in range(4)]


def test_capacity_is_never_exceeded(tier: Tier) -> None:
    results = [tier.put(make_key(i), make_chunk(i, CHUNK)) for i in range(CAPACITY_CHUNKS + 3)]
    assert results[:CAPACITY_CHUNKS] == [True] * CAPACITY_CHUNKS
    assert results[CAPACITY_CHUNKS:] == [False] * 3
    assert tier.used_bytes <= tier.capacity_bytes
    assert tier.get(make_key(CAPACITY_CHUNKS)) is None  # a refused put wrote nothing


def test_capacity_under_concurrent_puts(tier: Tier) -> None:
    def put_range(start: int) -> None:
        for i in range(start, start + 6):
            tier.put(make_key(i), make_chunk(i, CHUNK))

    threads = [threading.Thread(target=put_range, args=(k * 6,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tier.num_chunks == CAPACITY_CHUNKS
    assert tier.used_bytes <= tier.capacity_bytes


def test_wrong_output_size_is_an_error(tier: Tier) -> None:
    tier.put(make_key(1), make_chunk(1, CHUNK))
    with pytest.raises(InvalidArgument):
        tier.read_into(make_key(1), memoryview(bytearray(CHUNK - 1)))


def test_stats_and_slot_capability(tier: Tier) -> None:
    tier.put(make_key(1), make_chunk(1, CHUNK))
    stats = tier.stats()
    assert stats.name == tier.name and stats.num_chunks == 1
    assert stats.capacity_bytes == tier.capacity_bytes
    if isinstance(tier, SlotTier):
        slot = tier.slot_of(make_key(1))
        assert slot is not None and bytes(tier.view(slot)) == make_chunk(1, CHUNK)
        assert tier.segment().transport == "shm"


# -- batches report each item: what failed is neither stored nor counted ------------------------

BAD = (2, 5)
"""Keys whose writes the medium refuses in the tests below."""


@dataclass
class Faulty:
    """A tier whose medium refuses writes of the ``BAD`` keys, and a way to damage a chunk."""

    tier: Tier
    corrupt: Callable[[ChunkKey], None]


def _faulty_ssd(tmp_path: Path, request: pytest.FixtureRequest) -> Faulty:
    tier = SsdTier(tmp_path / "ssd", CAPACITY_CHUNKS * (CHUNK + 4096))
    for i in BAD:  # a file where the chunk's shard directory should be: its rename fails
        shard = tmp_path / "ssd" / "chunks" / make_key(i).hex()[:2]
        shard.rmdir()
        shard.write_bytes(b"")

    def corrupt(key: ChunkKey) -> None:
        name = key.hex()
        path = tmp_path / "ssd" / "chunks" / name[:2] / f"{name}.kv"
        os.truncate(path, 4096 + 10)

    return Faulty(tier, corrupt)


def _faulty_redis_on(request: pytest.FixtureRequest, fixture: str, cluster: bool) -> Faulty:
    """A Redis user who may read every key of the tier but write only those of good chunks:
    a SET of a ``BAD`` one gets ``-NOPERM``, with the connection left open."""
    from lmcache_svc.tiers.redis import RedisTier
    from lmcache_svc_bench.redis_procs import send_command

    procs = request.getfixturevalue(fixture)
    nodes = procs.nodes if cluster else [procs]
    prefix = f"contract-faulty-{uuid.uuid4().hex}:"
    allowed = [f"~{prefix}{make_key(i).hex()[:2]}*" for i in range(16) if i not in BAD]
    allowed.append(f"%R~{prefix}*")
    user, password = f"u{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    for node in nodes:
        reply = send_command(node.port, "ACL", "SETUSER", user, "on", f">{password}",
                             "resetkeys", *allowed, "+@all")  # fmt: skip
        assert reply.startswith(b"+OK"), reply
    url = f"redis://{user}:{password}@127.0.0.1:{nodes[0].port}/0"
    tier = RedisTier(url, CAPACITY_CHUNKS * (CHUNK + 128), cluster=cluster, key_prefix=prefix)
    admin = tier  # the default user (all keys) damages chunks for the read test

    def corrupt(key: ChunkKey) -> None:
        import redis

        client_cls = redis.RedisCluster if cluster else redis.Redis
        client = client_cls.from_url(nodes[0].url)
        try:
            client.set(admin._rkey(key), b"garbage")
        finally:
            client.close()

    return Faulty(tier, corrupt)


FAULTY = {
    "ssd": _faulty_ssd,
    "redis": lambda tmp_path, request: _faulty_redis_on(request, "redis_server", False),
    "redis_cluster": lambda tmp_path, request: _faulty_redis_on(request, "redis_cluster", True),
}
"""Every tier whose medium can fail (the CPU arena cannot: its batches only run out of room,
which ``test_batch_put_reports_no_room_per_item`` covers for every tier)."""


@pytest.fixture(params=sorted(FAULTY))
def faulty(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Faulty]:
    made = FAULTY[request.param](tmp_path, request)
    yield made
    made.tier.close()


def test_batch_put_reports_no_room_per_item(tier: Tier) -> None:
    items = [(make_key(i), make_chunk(i, CHUNK)) for i in range(CAPACITY_CHUNKS + 2)]
    assert tier.put_many(items) == [True] * CAPACITY_CHUNKS + [False] * 2
    assert tier.num_chunks == CAPACITY_CHUNKS and tier.used_bytes <= tier.capacity_bytes
    assert tier.contains_many([k for k, _ in items]) == [True] * CAPACITY_CHUNKS + [False] * 2


def test_batch_put_failures_are_per_item_and_not_counted(faulty: Faulty) -> None:
    tier = faulty.tier
    items = [(make_key(i), make_chunk(i, CHUNK)) for i in range(6)]
    results = tier.put_many(items)

    good = [i for i in range(6) if i not in BAD]
    assert [results[i] for i in good] == [True] * len(good)
    for i in BAD:
        assert isinstance(results[i], Failed) and isinstance(results[i].error, TierError)
        assert not results[i]  # falsy: all(results) still means "every item stored"
    assert tier.num_chunks == len(good)
    assert tier.contains_many([k for k, _ in items]) == [i not in BAD for i in range(6)]
    outs = [memoryview(bytearray(CHUNK)) for _ in good]
    assert tier.read_many_into([(make_key(i), o) for i, o in zip(good, outs)]) == [True] * 4
    assert [bytes(o) for o in outs] == [make_chunk(i, CHUNK) for i in good]
    for i in good:  # what succeeded can be removed, and then nothing is counted any more
        assert tier.delete(make_key(i)) > 0
    assert (tier.used_bytes, tier.num_chunks) == (0, 0)


def test_single_put_failure_raises(faulty: Faulty) -> None:
    with pytest.raises(TierError):
        faulty.tier.put(make_key(BAD[0]), make_chunk(0, CHUNK))
    assert (faulty.tier.used_bytes, faulty.tier.num_chunks) == (0, 0)


def test_batch_read_reports_a_corrupted_item_and_keeps_the_others(faulty: Faulty) -> None:
    tier = faulty.tier
    assert tier.put_many([(make_key(i), make_chunk(i, CHUNK)) for i in (0, 1, 3)]) == [True] * 3
    faulty.corrupt(make_key(1))
    outs = [memoryview(bytearray(CHUNK)) for _ in range(4)]
    results = tier.read_many_into([(make_key(i), o) for i, o in zip((0, 1, 3, 4), outs)])

    assert results[0] is True and results[2] is True and results[3] is False
    assert isinstance(results[1], Failed) and isinstance(results[1].error, Corrupted)
    assert (bytes(outs[0]), bytes(outs[2])) == (make_chunk(0, CHUNK), make_chunk(3, CHUNK))
    assert tier.contains_many([make_key(i) for i in (0, 1, 3)]) == [True, False, True]
    assert tier.num_chunks == 2  # the corrupted chunk was dropped and left the accounting


EXPECTED_MEDIA = {
    "cpu": "host_memory",
    "hbm": "device",
    "ssd": "disk",
    "redis": "remote",
    "redis_cluster": "remote",
}


def test_each_tier_says_where_it_keeps_its_bytes(
    tier: Tier, request: pytest.FixtureRequest
) -> None:
    """The medium is what a lookup reports per hit and what tells a server whether a call may
    block: a tier is asked, never recognised by name."""
    kind = request.node.callspec.params["tier"]
    assert tier.medium in MEDIA and tier.medium == EXPECTED_MEDIA[kind]
    assert tier.may_block == (tier.medium in ("disk", "remote"))

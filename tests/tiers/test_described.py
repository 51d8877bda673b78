"""Descriptions (token ids and parent) stored with the values of the SSD and Redis tiers
(``tiers/described.py``): written only when the store carried one, read back from the
headers alone, values of the previous format still loaded, damaged headers refused."""

from __future__ import annotations

import logging
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import xxhash

from lmcache_svc.errors import Corrupted
from lmcache_svc.tiers.base import ChunkDescription
from lmcache_svc.tiers.redis import HEADER as REDIS_HEADER
from lmcache_svc.tiers.redis import RedisTier
from lmcache_svc.tiers.redis_wire import check_value, pack_header
from lmcache_svc.tiers.ssd import BLOCK, SsdTier
from lmcache_svc_bench.redis_procs import RedisProc
from tests.helpers import make_chunk, make_key

SIZE = 4096
DESC = ChunkDescription(parent=bytes(range(32)), tokens=struct.pack("<256I", *range(256)))
MiB = 1 << 20


@pytest.fixture
def redis_tier(redis_server: RedisProc) -> Iterator[RedisTier]:
    tier = RedisTier(redis_server.url, 64 * MiB, key_prefix=f"desc:{uuid.uuid4().hex}:")
    yield tier
    tier.close()


@pytest.fixture
def raw(redis_server: RedisProc) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def read(tier: RedisTier | SsdTier, key: bytes) -> bytes | None:
    out = bytearray(SIZE)
    return bytes(out) if tier.read_into(key, memoryview(out)) else None  # type: ignore[arg-type]


# -- Redis ---------------------------------------------------------------------------------


def test_redis_stores_the_description_only_when_given(redis_tier, raw) -> None:
    redis_tier.put(make_key(1), make_chunk(1))  # no describe hook: the old value, byte for byte
    plain = raw.get(redis_tier._rkey(make_key(1)))
    assert len(plain) == REDIS_HEADER.size + SIZE and plain[4] == 1
    redis_tier.describe = {make_key(2): DESC}.get
    redis_tier.put_many([(make_key(2), make_chunk(2)), (make_key(3), make_chunk(3))])
    described = raw.get(redis_tier._rkey(make_key(2)))
    assert len(described) == REDIS_HEADER.size + 37 + 4 * 256 + SIZE and described[4] == 2
    assert raw.get(redis_tier._rkey(make_key(3)))[4] == 1  # the hook had none for it
    keys = [make_key(i) for i in (1, 2, 3, 4)]
    assert redis_tier.describe_many(keys) == [None, DESC, None, None]
    assert [read(redis_tier, k) for k in keys[:3]] == [make_chunk(i) for i in (1, 2, 3)]
    assert redis_tier.size_of(make_key(2)) == SIZE
    assert dict(redis_tier.rescan()) == {k: SIZE for k in keys[:3]}  # payload sizes


def test_redis_reads_a_value_of_the_previous_format(redis_tier, raw) -> None:
    """A value as the previous version wrote it (version 1, built here by hand)."""
    key, payload = make_key(5), make_chunk(5)
    header = struct.pack(
        "<4sBBHQQ48s", b"LMCR", 1, 0, 0, SIZE, xxhash.xxh3_64_intdigest(payload), key
    )
    raw.set(redis_tier._rkey(key), header + payload)
    assert dict(redis_tier.scan()) == {key: SIZE}
    assert read(redis_tier, key) == payload
    assert redis_tier.describe_many([key]) == [None]


def test_redis_refuses_a_header_whose_token_count_runs_past_the_value(
    redis_tier, raw, caplog: pytest.LogCaptureFixture
) -> None:
    key = make_key(6)
    redis_tier.describe = {key: DESC}.get
    redis_tier.put(key, make_chunk(6))
    value = bytearray(raw.get(redis_tier._rkey(key)))
    value[REDIS_HEADER.size : REDIS_HEADER.size + 4] = struct.pack("<I", 1 << 15)
    raw.set(redis_tier._rkey(key), bytes(value))
    with caplog.at_level(logging.WARNING):
        assert redis_tier.describe_many([key]) == [None]
    assert any(key.hex() in r.getMessage() for r in caplog.records)
    with pytest.raises(Corrupted, match=f"{key.hex()}.*description runs past"):
        read(redis_tier, key)
    assert raw.get(redis_tier._rkey(key)) is None  # deleted, like any damaged value


# -- SSD -----------------------------------------------------------------------------------


def test_ssd_keeps_the_description_across_a_restart(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, 10 * MiB)
    tier.put(make_key(1), make_chunk(1))
    tier.describe = {make_key(2): DESC}.get
    tier.put_many([(make_key(2), make_chunk(2))])
    tier.close()
    plain = (tmp_path / "chunks" / make_key(1).hex()[:2] / f"{make_key(1).hex()}.kv").read_bytes()
    assert plain[8:10] == b"\x01\x00" and plain[74:BLOCK] == bytes(BLOCK - 74)  # as before
    again = SsdTier(tmp_path, 10 * MiB)
    assert again.describe_many([make_key(1), make_key(2), make_key(3)]) == [None, DESC, None]
    assert read(again, make_key(2)) == make_chunk(2)
    again.close()


def test_ssd_reads_a_file_of_the_previous_format(tmp_path: Path) -> None:
    SsdTier(tmp_path, 10 * MiB).close()
    key, payload = make_key(7), make_chunk(7)
    header = struct.pack("<8sHQQ48s", b"LMCSVCS1", 1, SIZE, xxhash.xxh3_64_intdigest(payload), key)
    path = tmp_path / "chunks" / key.hex()[:2] / f"{key.hex()}.kv"
    path.write_bytes(header + bytes(BLOCK - len(header)) + payload)
    tier = SsdTier(tmp_path, 10 * MiB)
    assert read(tier, key) == payload
    assert tier.describe_many([key]) == [None]
    tier.close()


def test_ssd_refuses_a_description_whose_token_count_is_past_the_block(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = SsdTier(tmp_path, 10 * MiB)
    key = make_key(8)
    tier.describe = {key: DESC}.get
    tier.put(key, make_chunk(8))
    tier.close()
    path = tmp_path / "chunks" / key.hex()[:2] / f"{key.hex()}.kv"
    data = bytearray(path.read_bytes())
    data[74:78] = struct.pack("<I", 5000)
    path.write_bytes(bytes(data))
    tier = SsdTier(tmp_path, 10 * MiB)
    with caplog.at_level(logging.WARNING):
        assert tier.describe_many([key]) == [None]
    refusal = next(r.getMessage() for r in caplog.records if key.hex() in r.getMessage())
    assert "5000 tokens, at most 996" in refusal
    assert read(tier, key) == make_chunk(8)  # the payload is intact and still loads
    tier.close()


def test_a_description_too_large_for_the_ssd_block_is_not_stored(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, 10 * MiB)
    big = ChunkDescription(DESC.parent, bytes(4 * 1024))
    tier.describe = lambda k: big
    tier.put(make_key(9), make_chunk(9))
    assert tier.describe_many([make_key(9)]) == [None]
    assert read(tier, make_key(9)) == make_chunk(9)
    tier.close()


def test_redis_whole_value_check_reads_both_versions() -> None:
    """The check redis-py's fallback path (cluster redirections) makes of a whole value."""
    key, payload = make_key(10), make_chunk(10)
    for desc in (None, DESC):
        out = bytearray(SIZE)
        value = pack_header(key, payload, desc) + payload
        assert check_value(key, value, memoryview(out)) == ("ok", "")
        assert bytes(out) == payload
    damaged = bytearray(pack_header(key, payload, DESC) + payload)
    damaged[REDIS_HEADER.size] ^= 0x01  # 257 tokens: the payload would be 4 bytes short
    status, detail = check_value(key, bytes(damaged), memoryview(bytearray(SIZE)))
    assert (status, detail) == ("corrupt", "header says 4096 payload bytes, value holds 4092")

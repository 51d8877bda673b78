"""The lower tiers' indices stay what each tier holds when a batch partly fails.

A real redis-server whose ACL lets the tier's user write (or read) only some of its keys makes
Redis refuse part of a batch with ``-NOPERM`` on an open connection; the index, the tier's
accounting and Redis's own keys are then compared.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

from lmcache_svc.cache.lower_tier_manager import LowerTierManager
from lmcache_svc.cache.values import TierPolicy
from lmcache_svc.keys import ChunkKey
from lmcache_svc.metrics import Metrics
from lmcache_svc.tiers.redis import HEADER, RedisTier
from lmcache_svc_bench.redis_procs import RedisProc, send_command
from tests.helpers import make_chunk, make_key

CHUNK = 4096
BAD = {2, 5}


class Restricted:
    """A ``RedisTier`` logged in as a user with per-key ACL rights, plus an admin client."""

    def __init__(self, server: RedisProc, *, write_bad: bool, read_bad: bool) -> None:
        self.prefix = f"lower-{uuid.uuid4().hex}:"
        good = [f"{self.prefix}{make_key(i).hex()[:2]}*" for i in range(8) if i not in BAD]
        rights = [f"~{p}" for p in good]
        rights += [f"%W~{self.prefix}*"] if write_bad else []
        rights += [f"%R~{self.prefix}*"] if read_bad else []
        user, password = f"u{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
        reply = send_command(server.port, "ACL", "SETUSER", user, "on", f">{password}",
                             "resetkeys", *rights, "+@all")  # fmt: skip
        assert reply.startswith(b"+OK"), reply
        url = f"redis://{user}:{password}@127.0.0.1:{server.port}/0"
        self.tier = RedisTier(url, 64 * CHUNK, key_prefix=self.prefix, timeout_s=5.0)
        self.admin = redis.Redis.from_url(server.url)

    def held(self) -> dict[ChunkKey, int]:
        """What Redis holds under the tier's prefix: chunk key -> payload bytes."""
        names = self.admin.keys(self.prefix.encode() + b"*")
        return {
            ChunkKey(bytes.fromhex(n[len(self.prefix) :].decode())): self.admin.strlen(n)
            - HEADER.size
            for n in names
        }

    def close(self) -> None:
        self.admin.close()


@pytest.fixture
def restricted(redis_server: RedisProc) -> Iterator[Callable[..., Restricted]]:
    made: list[Restricted] = []

    def make(**rights: bool) -> Restricted:
        made.append(Restricted(redis_server, **rights))
        return made[-1]

    yield make
    for r in made:
        r.close()


def make_lower(tier: RedisTier) -> tuple[LowerTierManager, Metrics]:
    metrics = Metrics()
    policy = TierPolicy(accept_demotions=True, write_through=True)
    return LowerTierManager([(tier, policy)], metrics), metrics


def index_of(lower: LowerTierManager) -> dict[ChunkKey, int]:
    return dict(lower._tiers[0].contents)


def evict_all(lower: LowerTierManager) -> int:
    num = 0
    while lower._evict_one(0):
        num += 1
    return num


def test_write_through_with_refused_items_indexes_exactly_what_redis_holds(
    restricted: Callable[..., Restricted],
) -> None:
    r = restricted(write_bad=False, read_bad=True)
    lower, metrics = make_lower(r.tier)
    items = [(make_key(i), memoryview(make_chunk(i))) for i in range(8)]

    lower.copy_through(items)

    good = {make_key(i): CHUNK for i in range(8) if i not in BAD}
    assert r.held() == good
    assert index_of(lower) == good
    assert (r.tier.num_chunks, r.tier.used_bytes) == (len(good), len(good) * CHUNK)
    assert metrics.tier_errors.labels(tier="redis", kind="tier_unavailable")._value.get() == 2
    assert evict_all(lower) == len(good)  # what was stored can be evicted again
    assert r.held() == {} and (r.tier.num_chunks, r.tier.used_bytes) == (0, 0)
    lower.close()


def test_promotion_read_failures_keep_the_chunks_indexed(
    restricted: Callable[..., Restricted],
) -> None:
    r = restricted(write_bad=True, read_bad=False)
    lower, _ = make_lower(r.tier)
    lower.copy_through([(make_key(i), memoryview(make_chunk(i))) for i in range(8)])
    assert len(index_of(lower)) == 8 == len(r.held())

    plan = lower.sources([make_key(i) for i in range(8)])
    outs = [memoryview(bytearray(CHUNK)) for _ in range(8)]
    ok = lower.read_up([(make_key(i), lt, out) for i, (lt, out) in enumerate(zip(plan, outs))])

    assert ok == [i not in BAD for i in range(8)]
    assert all(bytes(outs[i]) == make_chunk(i) for i in range(8) if i not in BAD)
    assert set(index_of(lower)) == set(r.held())  # unreadable for now, still held and indexed
    assert evict_all(lower) == 8
    assert r.held() == {} and (r.tier.num_chunks, r.tier.used_bytes) == (0, 0)
    lower.close()


def test_a_partly_refused_batch_keeps_the_tier_in_use(
    restricted: Callable[..., Restricted],
) -> None:
    r = restricted(write_bad=False, read_bad=True)
    lower, metrics = make_lower(r.tier)
    lower.copy_through([(make_key(i), memoryview(make_chunk(i))) for i in range(8)])
    assert lower._tiers[0].breaker.state == "closed"
    assert metrics.breaker_trips.labels(tier="redis")._value.get() == 0
    lower.close()


def test_a_batch_that_fails_whole_marks_the_tier_down(
    redis_factory: Callable[..., RedisProc],
) -> None:
    """Batches report failures per item, never raising: a batch whose every item failed
    (Redis is gone) must still trip the breaker, so later calls skip the tier at once."""
    server = redis_factory()
    tier = RedisTier(server.url, 64 * CHUNK, key_prefix="whole:", timeout_s=2.0)
    lower, metrics = make_lower(tier)
    server.stop()

    lower.copy_through([(make_key(i), memoryview(make_chunk(i))) for i in range(4)])

    assert lower._tiers[0].breaker.state == "open"
    assert metrics.breaker_trips.labels(tier="redis")._value.get() == 1
    assert index_of(lower) == {}
    lower.copy_through([(make_key(9), memoryview(make_chunk(9)))])  # skipped, not tried
    assert metrics.tier_skips.labels(tier="redis", op="write_through")._value.get() == 1
    lower.close()

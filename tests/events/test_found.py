"""``FoundChunks``: found chunks wait for their namespace and their tier, and are forgotten
when the tier no longer holds them."""

from __future__ import annotations

from pathlib import Path

from lmcache_svc.keys import chunk_hash_packed, make_chunk_key
from lmcache_svc.server.events.found import FoundChunks, hashes_to
from lmcache_svc.tiers.base import ChunkDescription
from lmcache_svc.tiers.ssd import SsdTier
from tests.helpers import make_key, make_namespace

NS = make_namespace(chunk_size=4)
TOKENS = bytes(range(16))


def test_found_chunks_wait_for_their_tier_and_are_forgotten_when_dropped(tmp_path: Path) -> None:
    ssd, other = SsdTier(tmp_path / "a", 1 << 20, name="ssd"), SsdTier(tmp_path / "b", 1 << 20)
    other.name = "other"
    desc = ChunkDescription(bytes(32), TOKENS)
    found = FoundChunks()
    assert not found
    found.add(ssd, [(make_key(1), desc), (make_key(2), desc), (make_key(3), desc)])
    found.add(other, [(make_key(4), desc)])
    found.forget(ssd, make_key(3))
    found.tier_down(ssd)
    assert found.is_down(ssd)
    assert found.take(lambda k: True) == [(make_key(4), other, desc)]  # ssd's wait
    found.tier_holds(ssd, {make_key(1)})  # back up, no longer holding key 2
    assert not found.is_down(ssd)
    assert found.take(lambda k: k != make_key(1), ssd) == []
    assert found.take(lambda k: True, ssd) == [(make_key(1), ssd, desc)]
    assert not found
    ssd.close()
    other.close()


def test_a_description_is_the_chunks_only_if_it_hashes_to_it() -> None:
    first = make_chunk_key(NS.namespace_id, chunk_hash_packed(NS.namespace_id, TOKENS))
    assert hashes_to(first, ChunkDescription(NS.namespace_id, TOKENS))
    assert not hashes_to(first, ChunkDescription(NS.namespace_id, TOKENS[::-1]))
    assert not hashes_to(first, ChunkDescription(bytes(16), TOKENS))  # another namespace
    parent = bytes(range(32))
    second = make_chunk_key(NS.namespace_id, chunk_hash_packed(parent, TOKENS))
    assert hashes_to(second, ChunkDescription(parent, TOKENS))
    assert not hashes_to(second, ChunkDescription(parent[::-1], TOKENS))

"""KVCacheMemory's MemOS semantics on the in-process backend, and copies never stored objects."""

from __future__ import annotations

import uuid

import pytest
import torch

from lmcache_svc.errors import InvalidArgument
from lmcache_svc.kv_memory import KVCacheItem, KVCacheMemory
from lmcache_svc.kv_memory.cache_layers import build_cache, cache_layers
from lmcache_svc.kv_memory.tiny_model import sample_text


def _same_cache(a: object, b: object) -> bool:
    return all(
        torch.equal(ka, kb) and torch.equal(va, vb)
        for (ka, va), (kb, vb) in zip(cache_layers(a), cache_layers(b), strict=True)
    )


def test_extract_returns_an_item_not_added(memory: KVCacheMemory) -> None:
    item = memory.extract("w1 w2 w3")
    assert item.kv_cache.get_seq_length() == 4  # <s> w1 w2 w3
    assert item.token_ids == memory.llm.memory_ids("w1 w2 w3")
    assert item.metadata["source_text"] == "w1 w2 w3"
    assert item.model == memory.llm.identity
    assert memory.get_all() == []
    assert memory.get(item.kv_cache_id) is None


def test_item_aliases_follow_memos_names() -> None:
    cache = build_cache([(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16))])
    item = KVCacheItem(memory=cache, id=str(uuid.UUID(int=7)).upper())
    assert item.kv_cache is cache and item.memory is cache
    assert item.id == item.kv_cache_id == "00000000-0000-0000-0000-000000000007"
    with pytest.raises(ValueError):
        KVCacheItem(kv_cache_id="not-a-uuid")
    with pytest.raises(TypeError, match="not both"):
        KVCacheItem(kv_cache=cache, memory=cache)


def test_add_get_by_ids_get_all_delete(memory: KVCacheMemory) -> None:
    a, b = memory.extract("w1 w2"), memory.extract("w3 w4 w5")
    memory.add([a, b])
    missing = str(uuid.uuid4())
    got = memory.get_by_ids([b.id, missing, a.id, "not-a-uuid"])
    assert [g.id if g else None for g in got] == [b.id, None, a.id, None]
    assert got[0] is not None and _same_cache(got[0].kv_cache, b.kv_cache)
    assert got[0].token_ids == b.token_ids and got[0].metadata == b.metadata
    assert sorted(i.id for i in memory.get_all()) == sorted([a.id, b.id])
    memory.delete([a.id, missing, "junk"])
    assert [i.id for i in memory.get_all()] == [b.id]
    memory.delete_all()
    assert memory.get_all() == []


def test_add_replaces_an_id_already_stored(memory: KVCacheMemory) -> None:
    first = memory.extract("w1 w2")
    memory.add([first])
    second = memory.extract("w7 w8 w9")
    second.id = first.id
    memory.add([second])
    stored = memory.get(first.id)
    assert stored is not None and stored.token_ids == second.token_ids


def test_add_refuses_a_cache_that_does_not_fit_the_model(memory: KVCacheMemory) -> None:
    good = memory.extract("w1")
    alien = KVCacheItem(kv_cache=build_cache([(torch.zeros(1, 3, 2, 16),) * 2]))
    with pytest.raises(InvalidArgument, match="does not fit this model"):
        memory.add([good, alien])
    assert memory.get_all() == []  # checked before any is stored


def test_get_cache_skips_missing_and_is_none_when_nothing_is_left(memory: KVCacheMemory) -> None:
    a = memory.extract("w1 w2 w3")
    memory.add([a])
    assert memory.get_cache([str(uuid.uuid4())]) is None
    assert memory.get_cache([]) is None
    cache = memory.get_cache([str(uuid.uuid4()), a.id])
    assert cache is not None and _same_cache(cache, a.kv_cache)
    assert cache.get_seq_length() == 4


def test_generating_with_what_get_returned_never_changes_the_stored_memory(
    memory: KVCacheMemory,
) -> None:
    a = memory.extract(sample_text(20, 1))
    memory.add([a])
    ids = memory.prompt_ids("w5 w6", [a.id])
    for cache in (memory.get(a.id).kv_cache, memory.get_cache([a.id])):  # type: ignore[union-attr]
        memory.llm.generate(ids, cache, max_new_tokens=4)
        assert cache.get_seq_length() == len(ids) + 3  # the returned copy grew
        stored = memory.get(a.id)
        assert stored is not None and stored.kv_cache.get_seq_length() == 21
        assert _same_cache(stored.kv_cache, a.kv_cache)
    # Two gets are two objects.
    assert memory.get(a.id).kv_cache is not memory.get(a.id).kv_cache  # type: ignore[union-attr]


def test_from_textual_memory_keeps_its_metadata(memory: KVCacheMemory) -> None:
    class Meta:
        def model_dump(self) -> dict[str, object]:
            return {"user_id": "u1", "tags": ["x"]}

    class TextualMemoryItem:
        memory = "w4 w5 w6"
        metadata = Meta()

    item = memory.from_textual_memory(TextualMemoryItem())
    assert item.token_ids == memory.llm.memory_ids("w4 w5 w6")
    assert item.metadata == {"user_id": "u1", "tags": ["x"], "source_text": "w4 w5 w6"}


def test_add_refuses_bad_metadata_or_token_ids_clearly(memory: KVCacheMemory) -> None:
    item = memory.extract("w1 w2")
    item.metadata = {"when": object()}
    with pytest.raises(InvalidArgument, match="metadata is not JSON"):
        memory.add([item])
    item = memory.extract("w1 w2")
    item.token_ids = [1, 2]
    with pytest.raises(InvalidArgument, match="2 token ids for a cache of 3 tokens"):
        memory.add([item])
    assert memory.get_all() == []

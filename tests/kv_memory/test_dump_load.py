"""dump/load: safetensors + JSON metadata, never pickle; refusals leave the state unchanged."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lmcache_svc.errors import InvalidArgument, NoSpace
from lmcache_svc.kv_memory import InProcessBackend, KVCacheMemory
from lmcache_svc.kv_memory.blob import item_to_blob
from lmcache_svc.kv_memory.cache_layers import cache_layers
from lmcache_svc.kv_memory.model import LocalModel
from tests.kv_memory.conftest import memos_config


def _state(memory: KVCacheMemory) -> dict[str, list[int] | None]:
    return {item.id: item.token_ids for item in memory.get_all()}


def test_dump_writes_safetensors_with_the_model_identity_and_load_restores(
    memory: KVCacheMemory, tmp_path: Path
) -> None:
    a, b = memory.extract("w1 w2 w3"), memory.extract("w4 w5")
    memory.add([a, b])
    memory.dump(str(tmp_path / "d"))
    path = tmp_path / "d" / memory.config.memory_filename
    with safe_open(str(path), framework="pt") as f:
        header = f.metadata()
        assert f.get_tensor(f"{a.id}.layers.0.keys").shape == (1, 2, 4, 16)
    assert header["model"] == memory.llm.identity
    entries = json.loads(header["memories"])
    assert {e["memory_id"] for e in entries} == {a.id, b.id}
    memory.delete_all()
    c = memory.extract("w9")
    memory.add([c])
    memory.load(str(tmp_path / "d"))
    assert _state(memory) == {a.id: a.token_ids, b.id: b.token_ids}  # replaced, as MemOS does
    loaded = memory.get(a.id)
    assert loaded is not None and loaded.metadata == a.metadata
    for (k0, v0), (k1, v1) in zip(cache_layers(loaded.kv_cache), cache_layers(a.kv_cache)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (open, ("/nonexistent-dir/pwned", "w"))


def test_load_refuses_a_pickle_without_running_it(memory: KVCacheMemory, tmp_path: Path) -> None:
    a = memory.extract("w1 w2")
    memory.add([a])
    before = _state(memory)
    (tmp_path / memory.config.memory_filename).write_bytes(
        pickle.dumps({"kv_cache_memories": [_Boom()]}, protocol=pickle.HIGHEST_PROTOCOL)
    )
    with pytest.raises(InvalidArgument, match="pickle"):
        memory.load(str(tmp_path))
    assert _state(memory) == before


def test_load_refuses_another_models_memories(
    make_memory: Callable[..., KVCacheMemory], other_model_dir: Path, tmp_path: Path
) -> None:
    other = make_memory(LocalModel(str(other_model_dir)))
    other.add([other.extract("w1 w2")])
    other.dump(str(tmp_path))
    mine = make_memory()
    assert mine.llm.identity != other.llm.identity  # same config, other weights
    keep = mine.extract("w3")
    mine.add([keep])
    with pytest.raises(InvalidArgument, match=f"model '{other.llm.identity}'"):
        mine.load(str(tmp_path))
    assert _state(mine) == {keep.id: keep.token_ids}


@pytest.mark.parametrize("body", [b"", b"\x00" * 7, b"garbage that is not safetensors"])
def test_load_refuses_a_malformed_file(memory: KVCacheMemory, tmp_path: Path, body: bytes) -> None:
    a = memory.extract("w1")
    memory.add([a])
    (tmp_path / memory.config.memory_filename).write_bytes(body)
    with pytest.raises(InvalidArgument, match="not a memory dump"):
        memory.load(str(tmp_path))
    assert _state(memory) == {a.id: a.token_ids}


def test_load_of_a_missing_file_says_so(memory: KVCacheMemory, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no memory dump"):
        memory.load(str(tmp_path))


def test_a_dump_whose_header_length_starts_with_the_pickle_byte_loads(
    memory: KVCacheMemory, tmp_path: Path
) -> None:
    """A safetensors file starts with its header length: its low byte may be 0x80, the byte
    pickles start with. Such a dump is still a dump (this was refused as a pickle once)."""
    item = memory.extract("w1 w2")
    memory.add([item])
    path = tmp_path / memory.config.memory_filename
    for pad in range(300):
        item.metadata = {"pad": "x" * pad}
        memory.add([item])
        memory.dump(str(tmp_path))
        if path.read_bytes()[0] == 0x80:
            break
    else:
        pytest.fail("no padding gave a header length with low byte 0x80")
    memory.delete_all()
    memory.load(str(tmp_path))
    assert _state(memory) == {item.id: item.token_ids}


def test_a_load_the_service_cannot_hold_is_rolled_back(
    make_memory: Callable[..., KVCacheMemory], plain_model: LocalModel, tmp_path: Path
) -> None:
    source = make_memory()
    items = [source.extract(f"w{i} w{i + 1} w{i + 2}") for i in range(3)]
    source.add(items)
    source.dump(str(tmp_path))
    size = len(item_to_blob(items[0]))
    memory = KVCacheMemory(
        memos_config(Path(plain_model.path)),
        backend=InProcessBackend(capacity_bytes=int(size * 3.5)),
        model=plain_model,
    )
    replaced = memory.extract("w7 w8 w9")
    replaced.id = items[0].id  # the file's first memory replaces it, then space runs out
    other = memory.extract("w4 w5 w6")
    memory.add([replaced, other])
    before = _state(memory)
    with pytest.raises(NoSpace):
        memory.load(str(tmp_path))
    assert _state(memory) == before

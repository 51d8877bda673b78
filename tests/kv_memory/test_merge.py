"""get_cache's merge: agreement checks naming the mismatch, and position-correct keys."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lmcache_svc.errors import InvalidArgument
from lmcache_svc.kv_memory import KVCacheItem, KVCacheMemory
from lmcache_svc.kv_memory.cache_layers import build_cache, cache_layers
from lmcache_svc.kv_memory.model import LocalModel
from lmcache_svc.kv_memory.rope import rope_of
from lmcache_svc.kv_memory.tiny_model import TinySpec, build_tiny_llama, sample_text


def _variant(item: KVCacheItem, change: str) -> KVCacheItem:
    layers = cache_layers(item.kv_cache)
    if change == "layer count":
        layers = layers[:1]
    elif change == "KV heads":
        layers = [(k[:, :1], v[:, :1]) for k, v in layers]
    elif change == "head size":
        layers = [(k[..., :8], v[..., :8]) for k, v in layers]
    elif change == "dtype":
        layers = [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in layers]
    return KVCacheItem(kv_cache=build_cache(layers), token_ids=item.token_ids, model=item.model)


@pytest.mark.parametrize("change", ["layer count", "KV heads", "head size", "dtype"])
def test_get_cache_names_the_mismatch(memory: KVCacheMemory, change: str) -> None:
    a = memory.extract("w1 w2 w3")
    b = _variant(memory.extract("w4 w5"), change)
    memory.add([a, b])
    with pytest.raises(InvalidArgument, match=f"{change} .* != "):
        memory.get_cache([a.id, b.id])


def test_get_cache_refuses_another_models_memory(memory: KVCacheMemory) -> None:
    a = memory.extract("w1 w2 w3")
    b = memory.extract("w4 w5")
    b.model = "someone-else@0123456789abcdef"
    memory.add([a, b])
    with pytest.raises(InvalidArgument, match="someone-else@0123456789abcdef"):
        memory.get_cache([a.id, b.id])
    with pytest.raises(InvalidArgument, match="someone-else"):
        memory.get_cache([b.id])  # alone too: the cache is for this model


def _with_rope(path: Path, rope_scaling: dict[str, object] | None) -> Path:
    """Rewrite a saved model's config.json with another RoPE scaling (both spellings: 4.x
    reads rope_scaling, 5.x rope_parameters)."""
    if rope_scaling is not None:
        cfg = path / "config.json"
        data = json.loads(cfg.read_text())
        data["rope_scaling"] = rope_scaling
        data["rope_parameters"] = {"rope_theta": 10000.0, **rope_scaling}
        cfg.write_text(json.dumps(data))
    return path


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "rope_scaling",
    [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3],
    ids=["default", "linear", "llama3"],
)
def test_shifted_keys_equal_keys_computed_at_the_later_positions(
    tmp_path: Path, rope_scaling: dict[str, object] | None
) -> None:
    path = _with_rope(build_tiny_llama(tmp_path / "m", TinySpec(rope_theta=500.0)), rope_scaling)
    model = LocalModel(str(path))
    ids = torch.tensor([model.memory_ids(sample_text(40, 3))])
    offset = 137
    with torch.no_grad():
        at_zero = model.model(input_ids=ids, use_cache=True).past_key_values
        later = torch.arange(offset, offset + ids.shape[1]).unsqueeze(0)
        at_offset = model.model(input_ids=ids, position_ids=later, use_cache=True).past_key_values
    rope = rope_of(model.model)
    for (k0, v0), (k1, v1) in zip(cache_layers(at_zero), cache_layers(at_offset), strict=True):
        # Values carry no position (equal up to float rounding of relative attention).
        torch.testing.assert_close(v0, v1, atol=2e-5, rtol=1e-5)
        assert not torch.allclose(k0, k1, atol=1e-3)
        torch.testing.assert_close(rope.shift_keys(k0, offset), k1, atol=2e-5, rtol=1e-5)
    # The frequencies are the config's: a plain rope_theta=500 rotation would not match.
    if rope_scaling is not None:
        plain = LocalModel(str(build_tiny_llama(tmp_path / "p", TinySpec(rope_theta=500.0))))
        k0 = cache_layers(at_zero)[0][0]
        k1 = cache_layers(at_offset)[0][0]
        assert not torch.allclose(rope_of(plain.model).shift_keys(k0, offset), k1, atol=1e-3)


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return float((p.exp() * (p - q)).sum())


def test_merged_cache_is_much_closer_to_the_concatenated_prompt(memory: KVCacheMemory) -> None:
    """KL(prompt with both texts || merged cache), re-rotated vs MemOS's plain concatenation."""
    rerotated, naive = [], []
    for seed in range(6):
        a = memory.extract(sample_text(60, 100 + seed))
        b = memory.extract(sample_text(60, 200 + seed))
        memory.add([a, b])
        ids = memory.prompt_ids(sample_text(10, 300 + seed), [a.id, b.id])
        full = memory.llm.generate(ids, None, 1).first_logits
        for out, rerotate in ((rerotated, True), (naive, False)):
            cache = memory.get_cache([a.id, b.id], rerotate=rerotate)
            out.append(_kl(full, memory.llm.generate(ids, cache, 1).first_logits))
    mean_rerotated, mean_naive = statistics.mean(rerotated), statistics.mean(naive)
    print(f"KL to the prompt path: re-rotated {mean_rerotated:.4f}, naive {mean_naive:.4f}")
    assert mean_rerotated * 5 < mean_naive
    assert all(r < n for r, n in zip(rerotated, naive))
    # What still differs: the second text never attended to the first, so not zero.
    assert mean_rerotated > 1e-4


@pytest.mark.parametrize(
    ("rope_scaling", "message"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "RoPE type 'dynamic'"),
        (
            {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096},
            "RoPE type 'yarn'",
        ),
    ],
)
def test_unsupported_rope_types_are_refused_clearly(
    tmp_path: Path,
    make_memory: Callable[..., KVCacheMemory],
    rope_scaling: dict[str, object],
    message: str,
) -> None:
    path = _with_rope(build_tiny_llama(tmp_path / "m", TinySpec(num_layers=1)), rope_scaling)
    memory = make_memory(LocalModel(str(path)))
    a, b = memory.extract("w1 w2"), memory.extract("w3")
    memory.add([a, b])
    assert memory.get_cache([a.id]) is not None  # one memory needs no re-rotation
    with pytest.raises(InvalidArgument, match=message):
        memory.get_cache([a.id, b.id])

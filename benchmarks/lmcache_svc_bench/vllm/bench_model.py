"""A tiny random-weight Llama for end-to-end tests: ``config.json`` + ``model.safetensors``.

Why real random weights and not vLLM's ``load_format="dummy"``: dummy weights are uniform
in [-1e-3, 1e-3], so attention is flat and greedy output does not depend on the prompt's
prefix at all (measured: prompts with different first 512 tokens gave identical outputs).
"B's output equals the reference" would then pass even with garbage KV. Weights drawn with
a normal init (and sharper query/key projections) make the output depend on the prefix's
KV, which ``test_vllm.py`` checks with a corrupted-chunk control.

The weights are a pure function of ``seed`` (numpy's PCG64), written in the safetensors
format by hand (bf16 by truncating float32 with rounding), so this module needs only the
standard library and numpy: both the test venv and the vLLM venv import it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB_SIZE = 1024
HIDDEN = 256
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_SIZE = HIDDEN // NUM_HEADS
INTERMEDIATE = 512


@dataclass(frozen=True)
class Shape:
    num_layers: int = 4
    hidden: int = HIDDEN
    num_heads: int = NUM_HEADS
    num_kv_heads: int = NUM_KV_HEADS
    intermediate: int = INTERMEDIATE

    @property
    def head_size(self) -> int:
        return self.hidden // self.num_heads


TINY = Shape()
# REFERENCE.md's measurement model: 8 layers, hidden 1024, 8 KV heads (32 KiB of KV per token).
MEDIUM = Shape(num_layers=8, hidden=1024, num_heads=8, num_kv_heads=8, intermediate=2816)


def tiny_llama_config(shape: Shape = TINY, max_positions: int = 8192) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "num_hidden_layers": shape.num_layers,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": max_positions,
        "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def make_tiny_model(directory: Path, shape: Shape = TINY, *, seed: int = 0) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``directory``; returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_llama_config(shape)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    write_safetensors(directory / "model.safetensors", _weights(shape, seed))
    return directory


def _weights(shape: Shape, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(rows: int, cols: int, std: float) -> np.ndarray:
        return rng.standard_normal(size=(rows, cols), dtype=np.float32) * np.float32(std)

    h, inter = shape.hidden, shape.intermediate
    std = h**-0.5
    kv_dim = shape.num_kv_heads * shape.head_size
    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": normal(VOCAB_SIZE, h, 1.0),
        "model.norm.weight": np.ones(h, np.float32),
        "lm_head.weight": normal(VOCAB_SIZE, h, std),
    }
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(h, h, 2.5 * std)
        w[p + "self_attn.k_proj.weight"] = normal(kv_dim, h, 2.5 * std)
        w[p + "self_attn.v_proj.weight"] = normal(kv_dim, h, std)
        w[p + "self_attn.o_proj.weight"] = normal(h, h, std)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h, std)
        w[p + "mlp.up_proj.weight"] = normal(inter, h, std)
        w[p + "mlp.down_proj.weight"] = normal(h, inter, inter**-0.5)
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    return w


def to_bf16_bytes(array: np.ndarray) -> bytes:
    """float32 -> bfloat16 (round to nearest even), little-endian bytes."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype("<u2").tobytes()


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header: dict[str, object] = {}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        data = to_bf16_bytes(tensors[name])
        header[name] = {
            "dtype": "BF16",
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)

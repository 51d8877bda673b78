"""KV caches laid out exactly like vLLM 0.32's on CUDA, on any device.

vLLM 0.32 (``vllm/v1/kv_cache_layout.py``) describes a KV cache group by a logical shape
``[L, B, H, N, C]`` -- layers, blocks, KV heads, tokens of a block, and C = K then V contents
(``2 * head_size`` elements) -- and a physical stride permutation. The CUDA default,
``LBNHC`` (FlashAttention's "NHD"), stores ``[L, B, N, H, C]``: one backing buffer, layers
outermost, and each layer's connector view is the logical ``[B, H, N, C]`` permutation of its
``[B, N, H, C]`` slice. ``make_kv_caches`` builds exactly that, filled with seeded values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcache_svc.keys import KVLayout, Namespace

_AXES = "LBHNC"


@dataclass(frozen=True, slots=True)
class KVShape:
    num_layers: int = 4
    num_blocks: int = 32
    block_size: int = 16
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: torch.dtype = torch.bfloat16
    layout: str = "LBNHC"

    @property
    def page_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.block_size * self.num_kv_heads * 2 * self.head_size * elem


def make_kv_caches(
    shape: KVShape, *, seed: int, device: str | torch.device
) -> dict[str, torch.Tensor]:
    """``{layer name: logical [B, H, N, C] view}`` cut out of one backing buffer."""
    s = shape
    sizes = {"L": s.num_layers, "B": s.num_blocks, "H": s.num_kv_heads, "N": s.block_size}
    sizes["C"] = 2 * s.head_size
    gen = torch.Generator().manual_seed(seed)
    backing = torch.randn([sizes[a] for a in s.layout], generator=gen).to(s.dtype).to(device)
    logical = backing.permute([s.layout.index(a) for a in _AXES])  # [L, B, H, N, C]
    return {f"model.layers.{i}.self_attn.attn": logical[i] for i in range(s.num_layers)}


def namespace_for(shape: KVShape, model: str, chunk_size: int) -> Namespace:
    """The plugin's namespace for KV caches of ``shape`` on CUDA."""
    layout = KVLayout(
        str(shape.dtype).removeprefix("torch."),
        shape.num_layers,
        shape.num_kv_heads,
        shape.head_size,
        shape.block_size,
        f"vllm-cuda/{page_order(shape)}",
    )
    return Namespace(model=model, layout=layout, chunk_size=chunk_size)


def page_order(shape: KVShape) -> str:
    """The per-layer page order the plugin is configured with for this layout."""
    return shape.layout.replace("L", "")

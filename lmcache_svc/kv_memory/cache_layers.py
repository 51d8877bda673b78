"""Read and build transformers ``DynamicCache`` objects across transformers versions.

Supported: transformers 4.56 and later, including 5.x, where a ``DynamicCache`` holds
``layers[i].keys`` / ``layers[i].values`` tensors of shape [batch, kv_heads, seq, head_dim].
Caches are always built through ``DynamicCache.update``, the public API, so each layer's
initialised flag (4.57+) is set and ``get_seq_length()`` reports the real length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from lmcache_svc.errors import InvalidArgument

LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class CacheShape:
    """What two caches must agree on to be merged: everything but the sequence length."""

    num_layers: int
    batch: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def describe(self) -> str:
        return (
            f"{self.num_layers} layers, batch {self.batch}, {self.num_kv_heads} KV heads, "
            f"head size {self.head_dim}, {self.dtype}"
        )


def cache_layers(cache: object) -> list[LayerKV]:
    """The (keys, values) of every layer, as the tensors the cache holds (no copy)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise InvalidArgument(
            f"{type(cache).__name__} has no .layers: a transformers>=4.56 DynamicCache is needed"
        )
    out: list[LayerKV] = []
    for index, layer in enumerate(layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise InvalidArgument(f"cache layer {index} holds no key/value tensors")
        if keys.dim() != 4 or keys.shape != values.shape:
            raise InvalidArgument(
                f"cache layer {index}: keys {tuple(keys.shape)} and values "
                f"{tuple(values.shape)} are not both [batch, kv_heads, seq, head_dim]"
            )
        out.append((keys, values))
    if not out:
        raise InvalidArgument("the cache has no layers")
    return out


def shape_of(layers: Sequence[LayerKV]) -> CacheShape:
    """The cache's shape; ``InvalidArgument`` if its layers disagree with each other."""
    first = layers[0][0]
    shape = CacheShape(len(layers), first.shape[0], first.shape[1], first.shape[3], first.dtype)
    for index, (keys, values) in enumerate(layers):
        if keys.shape != first.shape or keys.dtype != first.dtype or values.dtype != first.dtype:
            raise InvalidArgument(
                f"cache layer {index} ({tuple(keys.shape)}, {keys.dtype}) disagrees with "
                f"layer 0 ({tuple(first.shape)}, {first.dtype})"
            )
    return shape


def seq_len(layers: Sequence[LayerKV]) -> int:
    return int(layers[0][0].shape[2])


def build_cache(layers: Sequence[LayerKV]) -> DynamicCache:
    """A new ``DynamicCache`` holding these tensors (``update`` copies them in)."""
    cache = DynamicCache()
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache

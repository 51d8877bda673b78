"""Merging several memories' caches into one, position-correct, with agreement checks.

Memory j of a merge starts at offset o_j = len(m_1) + ... + len(m_{j-1}) of the merged
sequence. Its values are copied as they are; its keys, computed at positions 0..len(m_j)-1,
are re-rotated by o_j (``rope.Rope.shift_keys``) so every key sits at its merged position,
as if the concatenated texts had been run at once. What still differs from that run: no
fragment attended to the fragments before it, so the keys and values of fragments 2.. are
those of text read without its preceding context.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from lmcache_svc.errors import InvalidArgument
from lmcache_svc.kv_memory.cache_layers import build_cache, cache_layers, seq_len, shape_of
from lmcache_svc.kv_memory.item import KVCacheItem
from lmcache_svc.kv_memory.rope import Rope


def check_agreement(items: Sequence[KVCacheItem], model_identity: str) -> None:
    """``InvalidArgument`` naming the first memory whose cache cannot join the others."""
    first = items[0]
    base = shape_of(cache_layers(first.kv_cache))
    for item in items:
        if item.model != model_identity:
            raise InvalidArgument(
                f"memory {item.kv_cache_id} was computed by model {item.model!r}, "
                f"not this memory's model {model_identity!r}"
            )
        shape = shape_of(cache_layers(item.kv_cache))
        for name, mine, theirs in (
            ("layer count", shape.num_layers, base.num_layers),
            ("batch size", shape.batch, base.batch),
            ("KV heads", shape.num_kv_heads, base.num_kv_heads),
            ("head size", shape.head_dim, base.head_dim),
            ("dtype", shape.dtype, base.dtype),
        ):
            if mine != theirs:
                raise InvalidArgument(
                    f"cannot merge memory {item.kv_cache_id} with {first.kv_cache_id}: "
                    f"{name} {mine} != {theirs}"
                )


def merge_caches(items: Sequence[KVCacheItem], rope: Rope | None) -> DynamicCache:
    """One new cache: the items' caches in order; keys re-rotated unless ``rope`` is None."""
    per_item = [cache_layers(item.kv_cache) for item in items]
    offsets = [0]
    for layers in per_item[:-1]:
        offsets.append(offsets[-1] + seq_len(layers))
    merged = []
    for index in range(len(per_item[0])):
        keys = [_place(layers[index][0], offset, rope) for layers, offset in zip(per_item, offsets)]
        values = [layers[index][1] for layers in per_item]
        merged.append((torch.cat(keys, dim=-2), torch.cat(values, dim=-2)))
    return build_cache(merged)


def _place(keys: torch.Tensor, offset: int, rope: Rope | None) -> torch.Tensor:
    return keys if rope is None else rope.shift_keys(keys, offset)

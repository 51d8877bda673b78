"""One memory as one safetensors blob: the format the service stores and ``dump`` writes.

Tensors: ``layers.{i}.keys`` and ``layers.{i}.values`` ([batch, kv_heads, seq, head_dim], the
cache's dtype) for every layer i, and ``token_ids`` (int64 [seq]) when the tokens are known.
Header ``__metadata__`` (str -> str): ``lmcache_svc.memory_format`` = "1", ``memory_id`` (the
UUID), ``model`` (the model identity), ``metadata`` (the item's metadata as a JSON string).
Parsing never runs code: safetensors is a JSON header plus raw tensor bytes.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from lmcache_svc.errors import InvalidArgument
from lmcache_svc.memory.cache_layers import build_cache, cache_layers, shape_of
from lmcache_svc.memory.item import KVCacheItem, canonical_memory_id

FORMAT_KEY = "lmcache_svc.memory_format"
FORMAT_VERSION = "1"


def item_to_blob(item: KVCacheItem) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    for index, (keys, values) in enumerate(cache_layers(item.kv_cache)):
        tensors[f"layers.{index}.keys"] = keys.detach().cpu().contiguous()
        tensors[f"layers.{index}.values"] = values.detach().cpu().contiguous()
    if item.token_ids is not None:
        tensors["token_ids"] = torch.tensor(item.token_ids, dtype=torch.int64)
    header = {
        FORMAT_KEY: FORMAT_VERSION,
        "memory_id": item.kv_cache_id,
        "model": item.model or "",
        "metadata": json.dumps(item.metadata, sort_keys=True),
    }
    return bytes(st_save(tensors, metadata=header))


def blob_header(blob: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a memory blob, checked; ``InvalidArgument`` if it is not one."""
    if len(blob) < 8:
        raise InvalidArgument("not a safetensors memory blob: shorter than its 8-byte header")
    (length,) = struct.unpack("<Q", blob[:8])
    if length > len(blob) - 8:
        raise InvalidArgument("not a safetensors memory blob: header length past the end")
    try:
        header = json.loads(blob[8 : 8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InvalidArgument("not a safetensors memory blob: header is not JSON") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get(FORMAT_KEY) != FORMAT_VERSION:
        raise InvalidArgument(f"not a memory blob: {FORMAT_KEY} is not {FORMAT_VERSION!r}")
    for key in ("memory_id", "model", "metadata"):
        if not isinstance(meta.get(key), str):
            raise InvalidArgument(f"memory blob header lacks {key!r}")
    return meta


def item_from_blob(blob: bytes) -> KVCacheItem:
    meta = blob_header(blob)
    try:
        memory_id = canonical_memory_id(meta["memory_id"])
        metadata = json.loads(meta["metadata"])
        tensors = st_load(bytes(blob))
    except (ValueError, SafetensorError) as exc:
        raise InvalidArgument(f"bad memory blob: {exc}") from None
    if not isinstance(metadata, dict):
        raise InvalidArgument("bad memory blob: metadata is not a JSON object")
    layers = _layers(tensors)
    shape_of(layers)
    token_ids = tensors.get("token_ids")
    return KVCacheItem(
        kv_cache=build_cache(layers),
        kv_cache_id=memory_id,
        metadata=metadata,
        token_ids=None if token_ids is None else [int(t) for t in token_ids.tolist()],
        model=meta["model"] or None,
    )


def _layers(tensors: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = []
    index = 0
    while f"layers.{index}.keys" in tensors:
        values = tensors.get(f"layers.{index}.values")
        if values is None:
            raise InvalidArgument(f"bad memory blob: layers.{index}.values missing")
        layers.append((tensors[f"layers.{index}.keys"], values))
        index += 1
    if not layers:
        raise InvalidArgument("bad memory blob: no layers.0.keys tensor")
    return layers


def describe_blob(blob: bytes) -> dict[str, Any]:
    meta = blob_header(blob)
    return {"memory_id": meta["memory_id"], "model": meta["model"], "size_bytes": len(blob)}

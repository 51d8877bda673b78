"""One memory as one safetensors blob: the format the service stores and ``dump`` writes.

Tensors: ``layers.{i}.keys`` and ``layers.{i}.values`` ([batch, kv_heads, seq, head_dim], the
cache's dtype) for every layer i, and ``token_ids`` (int64 [seq]) when the tokens are known.
Header ``__metadata__`` (str -> str): ``lmcache_svc.memory_format`` = "1", ``memory_id`` (the
UUID), ``model`` (the model identity), ``metadata`` (the item's metadata as a JSON string).
Parsing never runs code: safetensors is a JSON header plus raw tensor bytes; the header is
checked by the service's own parser (``lmcache_svc.memory_blob``).
"""

from __future__ import annotations

import json
import warnings

import torch
from safetensors.torch import save as st_save

from lmcache_svc.errors import InvalidArgument
from lmcache_svc.kv_memory.cache_layers import build_cache, cache_layers, shape_of
from lmcache_svc.kv_memory.item import KVCacheItem
from lmcache_svc.memory_blob import FORMAT_KEY, FORMAT_VERSION, parse_memory

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


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


def item_from_blob(blob: bytes) -> KVCacheItem:
    """A new item from a blob; ``InvalidArgument`` (``BadMemory``) if it is not a memory."""
    info = parse_memory(blob)  # checks the header and that the tensors tile the data
    tensors = tensor_views(bytes(blob))
    layers = _layers(tensors)
    shape_of(layers)
    token_ids = tensors.get("token_ids")
    return KVCacheItem(
        kv_cache=build_cache(layers),
        kv_cache_id=info.memory_id,
        metadata=info.metadata,
        token_ids=None if token_ids is None else [int(t) for t in token_ids.tolist()],
        model=info.model or None,
    )


def tensor_views(blob: bytes) -> dict[str, torch.Tensor]:
    """Read-only tensors viewing ``blob``'s data (no copy: ``build_cache`` makes the one copy).

    ``blob`` must have passed ``parse_memory``, which checks every offset and size.
    """
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + length])
    start = 8 + length
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # non-writable buffer: never written
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(entry["dtype"])
            if dtype is None:
                raise InvalidArgument(
                    f"bad memory blob: tensor {name!r} has dtype {entry['dtype']}"
                )
            begin, end = entry["data_offsets"]
            flat = (
                torch.frombuffer(
                    blob, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=start + begin
                )
                if end > begin
                else torch.empty(0, dtype=dtype)
            )
            out[name] = flat.view(entry["shape"])
    return out


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

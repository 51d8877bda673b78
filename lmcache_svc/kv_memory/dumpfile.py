"""``dump``/``load``'s file: all memories in one safetensors file, never pickle.

Tensors: ``{memory_id}.layers.{i}.keys``, ``{memory_id}.layers.{i}.values`` and
``{memory_id}.token_ids`` for each memory. Header ``__metadata__``:
``lmcache_svc.memory_dump_format`` = "1", ``model`` (the identity of the model that wrote it)
and ``memories``, a JSON list of ``{"memory_id", "model", "metadata"}`` in dump order.
Reading parses the whole file into new items before anything else happens; it never runs
code from the file.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from lmcache_svc.errors import InvalidArgument
from lmcache_svc.kv_memory.cache_layers import build_cache, cache_layers, shape_of
from lmcache_svc.kv_memory.item import KVCacheItem, canonical_memory_id

DUMP_FORMAT_KEY = "lmcache_svc.memory_dump_format"
DUMP_FORMAT_VERSION = "1"
PICKLE_PROTO = 0x80


def write_dump(path: str, items: Sequence[KVCacheItem], model_identity: str) -> None:
    tensors: dict[str, torch.Tensor] = {}
    entries = []
    for item in items:
        for index, (keys, values) in enumerate(cache_layers(item.kv_cache)):
            tensors[f"{item.kv_cache_id}.layers.{index}.keys"] = keys.contiguous()
            tensors[f"{item.kv_cache_id}.layers.{index}.values"] = values.contiguous()
        if item.token_ids is not None:
            tensors[f"{item.kv_cache_id}.token_ids"] = torch.tensor(item.token_ids)
        entries.append(
            {"memory_id": item.kv_cache_id, "model": item.model, "metadata": item.metadata}
        )
    header = {
        DUMP_FORMAT_KEY: DUMP_FORMAT_VERSION,
        "model": model_identity,
        "memories": json.dumps(entries, sort_keys=True),
    }
    data = st_save(tensors, metadata=header)
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".memory-dump-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_dump(path: str, model_identity: str) -> list[KVCacheItem]:
    """The file's memories; ``InvalidArgument`` for a pickle, a bad file or another model's."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        tensors = st_load(data)
        header = _header(data)
    except (SafetensorError, ValueError) as exc:
        if _looks_like_pickle(data):
            raise InvalidArgument(
                f"{path} is a pickle file (MemOS's dump format?): refusing to unpickle it, "
                "since loading a pickle runs code from the file; re-extract the memories instead"
            ) from None
        raise InvalidArgument(f"{path} is not a memory dump (safetensors): {exc}") from None
    if header.get("model") != model_identity:
        raise InvalidArgument(
            f"{path} holds memories of model {header.get('model')!r}, "
            f"not this memory's model {model_identity!r}"
        )
    items = [_item(entry, tensors, path) for entry in _entries(header, path)]
    for item in items:
        if item.model != model_identity:
            raise InvalidArgument(
                f"{path}: memory {item.kv_cache_id} is of model {item.model!r}, "
                f"not {model_identity!r}"
            )
    return items


def _looks_like_pickle(data: bytes) -> bool:
    """Pickle protocols 2-5 start with PROTO (0x80) and the protocol number."""
    return len(data) > 2 and data[0] == PICKLE_PROTO and 2 <= data[1] <= 5


def _header(data: bytes) -> dict[str, str]:
    length = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + length]).get("__metadata__") or {}
    if meta.get(DUMP_FORMAT_KEY) != DUMP_FORMAT_VERSION:
        raise ValueError(f"{DUMP_FORMAT_KEY} is not {DUMP_FORMAT_VERSION!r}")
    return dict(meta)


def _entries(header: dict[str, str], path: str) -> list[dict[str, object]]:
    try:
        entries = json.loads(header.get("memories", ""))
    except json.JSONDecodeError:
        raise InvalidArgument(f"{path}: the memories list is not JSON") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise InvalidArgument(f"{path}: the memories list is not a list of objects")
    return entries


def _item(entry: dict[str, object], tensors: dict[str, torch.Tensor], path: str) -> KVCacheItem:
    try:
        memory_id = canonical_memory_id(str(entry.get("memory_id")))
    except ValueError:
        raise InvalidArgument(f"{path}: bad memory id {entry.get('memory_id')!r}") from None
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []
    while f"{memory_id}.layers.{len(layers)}.keys" in tensors:
        prefix = f"{memory_id}.layers.{len(layers)}"
        if f"{prefix}.values" not in tensors:
            raise InvalidArgument(f"{path}: {prefix}.values missing")
        layers.append((tensors[f"{prefix}.keys"], tensors[f"{prefix}.values"]))
    if not layers:
        raise InvalidArgument(f"{path}: memory {memory_id} has no layers")
    shape_of(layers)
    metadata = entry.get("metadata")
    if not isinstance(metadata, dict):
        raise InvalidArgument(f"{path}: memory {memory_id}'s metadata is not an object")
    token_ids = tensors.get(f"{memory_id}.token_ids")
    return KVCacheItem(
        kv_cache=build_cache(layers),
        kv_cache_id=memory_id,
        metadata=metadata,
        token_ids=None if token_ids is None else [int(t) for t in token_ids.tolist()],
        model=str(entry.get("model")) if entry.get("model") else None,
    )

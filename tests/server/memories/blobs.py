"""A pure-Python safetensors writer for tests: memory blobs, good and deliberately bad."""

from __future__ import annotations

import json
import struct
import uuid
from typing import Any

Tensor = tuple[str, list[int], bytes]
"""dtype, shape, raw bytes"""


def tensor(shape: list[int], *, dtype: str = "F16", seed: int = 0) -> Tensor:
    size = {"F16": 2, "BF16": 2, "F32": 4, "U8": 1}[dtype]
    n = size
    for d in shape:
        n *= d
    return dtype, shape, bytes((seed * 31 + i * 7) % 251 for i in range(n))


def default_tensors(seed: int = 0) -> dict[str, Tensor]:
    return {
        "layers.0.keys": tensor([1, 2, 3, 4], seed=seed),
        "layers.0.values": tensor([1, 2, 3, 4], seed=seed + 1),
    }


def memory_metadata(
    memory_id: str, *, model: str = "test-model", metadata: dict[str, Any] | None = None
) -> dict[str, str]:
    return {
        "lmcache_svc.memory_format": "1",
        "memory_id": memory_id,
        "model": model,
        "metadata": json.dumps(metadata if metadata is not None else {"source": "test"}),
    }


def safetensors_bytes(
    tensors: dict[str, Tensor], metadata: dict[str, str] | None, *, header_extra: Any = None
) -> bytes:
    """Tensors laid out back to back in name order, as the safetensors library does."""
    header: dict[str, Any] = {}
    data = bytearray()
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    if metadata is not None:
        header["__metadata__"] = metadata
    if header_extra is not None:
        header.update(header_extra)
    raw_header = json.dumps(header).encode()
    return struct.pack("<Q", len(raw_header)) + raw_header + bytes(data)


def make_memory(
    memory_id: str | None = None,
    *,
    model: str = "test-model",
    metadata: dict[str, Any] | None = None,
    seed: int = 0,
    tensors: dict[str, Tensor] | None = None,
) -> bytes:
    """A valid memory blob."""
    mid = memory_id or str(uuid.uuid4())
    meta = memory_metadata(mid, model=model, metadata=metadata)
    return safetensors_bytes(tensors or default_tensors(seed), meta)


def memory_id_of(blob: bytes) -> str:
    (n,) = struct.unpack("<Q", blob[:8])
    return str(json.loads(blob[8 : 8 + n])["__metadata__"]["memory_id"])

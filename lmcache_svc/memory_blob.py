"""What makes a byte string a memory: a well-formed safetensors blob whose header metadata
names it. Checked in pure Python from the JSON header and the sizes, without torch.

The safetensors layout: an 8-byte little-endian header length N, N bytes of a JSON object,
then the data. Each tensor entry gives ``dtype``, ``shape`` and ``data_offsets`` [begin, end)
relative to the data; the entries must tile the data exactly (no gap, no overlap, nothing
after), as the safetensors library itself requires. ``__metadata__`` (str -> str) must hold
``lmcache_svc.memory_format`` = "1", ``memory_id`` (a canonical lowercase UUID), ``model``
(non-empty) and ``metadata`` (a JSON object, as a string).

Parsing is bounded, since a header comes from a client or from a file on disk: the prefix's
length is checked against ``MAX_HEADER_BYTES`` before anything is decoded; integers longer
than ``MAX_INT_DIGITS`` digits, ``NaN``/``Infinity`` and floats that overflow are refused as
the JSON is read (so the item metadata a server returns is always standard JSON); arrays
and objects nested deeper than ``MAX_DEPTH`` are refused before the decoder sees them; a
header may describe at most ``MAX_TENSORS`` tensors. Every refusal is ``BadMemory`` naming
the problem.
"""

from __future__ import annotations

import json
import math
import re
import struct
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmcache_svc.errors import BadMemory, InvalidArgument

FORMAT_KEY = "lmcache_svc.memory_format"
FORMAT_VERSION = "1"
REQUIRED_KEYS = (FORMAT_KEY, "memory_id", "model", "metadata")
MAX_TENSORS = 2048
"""Tensors one memory may hold: a memory has two per layer (keys, values) and ``token_ids``,
so this is 1,023 layers, eight times the deepest public models (about 126 layers)."""
MAX_HEADER_BYTES = 1 << 20
"""The JSON header's limit (the safetensors library allows 100 MB): ``MAX_TENSORS`` entries
take about 120 bytes each (250 KiB), which leaves the item metadata about 750 KiB."""
MAX_INT_DIGITS = 20
"""Longest integer in a header or in item metadata: any uint64 (offsets, shapes)."""
MAX_DEPTH = 64
"""Deepest nesting of arrays and objects in a header or in item metadata (a header nests
3 deep). Checked before decoding: the decoder recursed up to the interpreter's limit on
a hostile header, and a finalizer that the garbage collector ran down there failed with
``RecursionError`` (an unraisable exception in a CI run)."""
PREFIX_BYTES = 8

DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """A stored memory as listed: its id, the blob's size, model identity and metadata."""

    memory_id: str
    size_bytes: int
    model: str
    metadata: dict[str, Any]


def header_length(prefix: bytes, total_bytes: int) -> int:
    """The JSON header's length from the blob's first 8 bytes, checked against its size."""
    if total_bytes < PREFIX_BYTES or len(prefix) < PREFIX_BYTES:
        raise BadMemory(f"not safetensors: {total_bytes} bytes, shorter than the 8-byte prefix")
    (n,) = struct.unpack("<Q", prefix[:PREFIX_BYTES])
    if n < 2 or n > MAX_HEADER_BYTES or PREFIX_BYTES + n > total_bytes:
        raise BadMemory(
            f"not safetensors: the prefix gives a {n}-byte header, but the blob has "
            f"{total_bytes - PREFIX_BYTES} bytes after the prefix (limit {MAX_HEADER_BYTES})"
        )
    return int(n)


def parse_header(head: bytes, total_bytes: int) -> MemoryInfo:
    """Check a blob from its first ``8 + N`` bytes and its total size; its ``MemoryInfo``."""
    n = header_length(head, total_bytes)
    if len(head) < PREFIX_BYTES + n:
        raise BadMemory(f"not safetensors: header cut short ({len(head) - PREFIX_BYTES} of {n})")
    header = _load_json(bytes(head[PREFIX_BYTES : PREFIX_BYTES + n]))
    metadata = header.pop("__metadata__", None)
    _check_tensors(header, total_bytes - PREFIX_BYTES - n)
    return _memory_info(metadata, total_bytes)


def parse_memory(blob: bytes | bytearray | memoryview) -> MemoryInfo:
    """Check a whole blob; raises ``BadMemory`` naming the first problem found."""
    view = memoryview(blob).cast("B")
    n = header_length(bytes(view[:PREFIX_BYTES]), len(view))
    return parse_header(bytes(view[: PREFIX_BYTES + n]), len(view))


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise BadMemory(f"bad safetensors header: key {key!r} appears twice")
        out[key] = value
    return out


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise BadMemory(
            f"an integer of {len(text.lstrip('-'))} digits; at most {MAX_INT_DIGITS} are allowed"
        )
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadMemory(f"number {text[:40]} is out of range (not a finite float)")
    return value


def _no_constant(name: str) -> Any:
    raise BadMemory(f"{name} is not standard JSON")


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth(text: str) -> int:
    """How deep the arrays and objects of ``text`` nest (brackets in strings skipped), in
    a few passes at C speed, without decoding it (a running sum of +1 per opening and -1
    per closing bracket: for a 1 MiB header of ``[]``, 34 ms where a Python loop over the
    brackets took 61)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).encode("ascii")
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return max(0, int(np.cumsum(steps).max()))


def bounded_json(text: str, *, what: str, expected: str = "JSON", **hooks: Any) -> Any:
    """``json.loads`` with the bounds of this module; ``BadMemory`` naming ``what``."""
    if json_depth(text) > MAX_DEPTH:
        raise BadMemory(f"{what} is nested too deeply (more than {MAX_DEPTH} levels)")
    try:
        return json.loads(
            text,
            parse_int=_bounded_int,
            parse_float=_finite_float,
            parse_constant=_no_constant,
            **hooks,
        )
    except BadMemory as e:
        raise BadMemory(f"{what}: {e}") from None
    except RecursionError:
        raise BadMemory(f"{what} is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, or anything else the decoder refuses
        raise BadMemory(f"{what} is not {expected} ({e})") from None


def _load_json(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadMemory(f"not safetensors: the header is not UTF-8 JSON ({e})") from None
    header = bounded_json(
        text,
        what="not safetensors: the header",
        expected="UTF-8 JSON",
        object_pairs_hook=_reject_duplicates,
    )
    if not isinstance(header, dict):
        raise BadMemory("not safetensors: the header is not a JSON object")
    return header


def _check_tensors(header: dict[str, Any], data_bytes: int) -> None:
    if len(header) > MAX_TENSORS:
        raise BadMemory(
            f"the header describes {len(header)} tensors; at most {MAX_TENSORS} are allowed "
            "(two per layer and token_ids: see docs/memories.md)"
        )
    spans = sorted((_tensor_span(name, entry), name) for name, entry in header.items())
    offset = 0
    for (begin, end), name in spans:
        if begin != offset:
            what = "overlaps the tensor before it" if begin < offset else "leaves a gap before it"
            raise BadMemory(f"tensor {name!r}: data_offsets start at {begin}, which {what}")
        offset = end
    if offset != data_bytes:
        raise BadMemory(
            f"the tensors cover {offset} bytes of data, but the blob holds {data_bytes} bytes "
            "after its header"
        )


def _tensor_span(name: str, entry: Any) -> tuple[int, int]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise BadMemory(f"tensor {name!r}: expected exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BYTES:
        raise BadMemory(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise BadMemory(f"tensor {name!r}: shape must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise BadMemory(f"tensor {name!r}: data_offsets must be [begin, end] integers")
    begin, end = offsets
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != expected:
        raise BadMemory(
            f"tensor {name!r}: shape {shape} of {dtype} takes {expected} bytes, but "
            f"data_offsets {offsets} span {end - begin}"
        )
    return begin, end


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _memory_info(metadata: Any, total_bytes: int) -> MemoryInfo:
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise BadMemory("the header's __metadata__ must be a map of strings to strings")
    missing = [k for k in REQUIRED_KEYS if k not in metadata]
    if missing:
        raise BadMemory(f"__metadata__ lacks {', '.join(missing)} (see docs/memories.md)")
    if metadata[FORMAT_KEY] != FORMAT_VERSION:
        raise BadMemory(
            f"{FORMAT_KEY} is {metadata[FORMAT_KEY]!r}; this server reads {FORMAT_VERSION!r}"
        )
    if not metadata["model"]:
        raise BadMemory("__metadata__.model must name the model (it is empty)")
    return MemoryInfo(
        memory_id=check_memory_id(metadata["memory_id"]),
        size_bytes=total_bytes,
        model=metadata["model"],
        metadata=_item_metadata(metadata["metadata"]),
    )


def _item_metadata(raw: str) -> dict[str, Any]:
    value = bounded_json(raw, what="__metadata__.metadata")
    if not isinstance(value, dict):
        raise BadMemory("__metadata__.metadata must be a JSON object")
    return value


def check_memory_id(value: str) -> str:
    """``value`` if it is a canonical lowercase UUID (8-4-4-4-12), else ``InvalidArgument``."""
    try:
        canonical = str(uuid.UUID(value))
    except (ValueError, TypeError, AttributeError):
        canonical = None
    if canonical != value:
        raise InvalidArgument(
            f"memory id {value!r} is not a canonical lowercase UUID "
            "(like 0f8fad5b-d9cb-469f-a165-70867728950e)"
        )
    return value

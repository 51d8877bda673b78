"""The memory blob check: well-formed safetensors with the service's metadata, no torch."""

from __future__ import annotations

import json
import struct
import uuid
from typing import Any

import numpy as np
import pytest

from lmcache_svc.errors import BadMemory, InvalidArgument
from lmcache_svc.memory_blob import (
    MAX_DEPTH,
    check_memory_id,
    json_depth,
    parse_header,
    parse_memory,
)
from tests.server.memories.blobs import (
    default_tensors,
    make_memory,
    memory_metadata,
    safetensors_bytes,
    tensor,
)

MID = "0f8fad5b-d9cb-469f-a165-70867728950e"


def raw_blob(header: Any, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw)) + raw + data


def good_header(**tensor_entries: Any) -> dict[str, Any]:
    return {"__metadata__": memory_metadata(MID), **tensor_entries}


def test_a_valid_blob_gives_its_info() -> None:
    blob = make_memory(MID, model="llama@abc", metadata={"turn": 3, "tags": ["faq"]})
    info = parse_memory(blob)
    assert info.memory_id == MID
    assert info.size_bytes == len(blob)
    assert info.model == "llama@abc"
    assert info.metadata == {"turn": 3, "tags": ["faq"]}


def test_header_alone_with_the_total_size_gives_the_same_info() -> None:
    blob = make_memory(MID)
    (n,) = struct.unpack("<Q", blob[:8])
    assert parse_header(blob[: 8 + n], len(blob)) == parse_memory(blob)


def test_scalars_and_empty_tensors_are_well_formed() -> None:
    tensors = {"scalar": tensor([]), "empty": tensor([0, 4]), "x": tensor([2, 2], dtype="BF16")}
    blob = safetensors_bytes(tensors, memory_metadata(MID))
    assert parse_memory(blob).size_bytes == len(blob)


def test_blob_written_by_the_safetensors_library_is_accepted() -> None:
    st = pytest.importorskip("safetensors.numpy")
    arrays = {
        "layers.0.keys": np.arange(24, dtype=np.float16).reshape(1, 2, 3, 4),
        "layers.0.values": np.ones((1, 2, 3, 4), dtype=np.float32),
        "ids": np.arange(5, dtype=np.int64),
    }
    blob = st.save(arrays, metadata=memory_metadata(MID, metadata={"k": "v"}))
    info = parse_memory(blob)
    assert (info.memory_id, info.metadata, info.size_bytes) == (MID, {"k": "v"}, len(blob))
    # and what we write, the library reads
    ours = safetensors_bytes(default_tensors(), memory_metadata(MID))
    assert set(st.load(ours)) == {"layers.0.keys", "layers.0.values"}


F16_2x2 = {"dtype": "F16", "shape": [2, 2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("blob", "fragment"),
    [
        (b"", "shorter than the 8-byte prefix"),
        (b"\x01\x02\x03", "shorter than the 8-byte prefix"),
        (struct.pack("<Q", 1000) + b"{}", "1000-byte header"),
        (struct.pack("<Q", 2**63) + b"{}", "header"),
        (raw_blob(b"\xff\xfe not json"), "not UTF-8 JSON"),
        (raw_blob(b'{"a": '), "not UTF-8 JSON"),
        (raw_blob([1, 2]), "not a JSON object"),
        (raw_blob(b'{"__metadata__": {}, "__metadata__": {}}'), "appears twice"),
        (raw_blob(good_header(t={"dtype": "F16", "shape": [2, 2]}), bytes(8)), "exactly dtype"),
        (raw_blob(good_header(t={**F16_2x2, "dtype": "Q4"}), bytes(8)), "unknown dtype 'Q4'"),
        (raw_blob(good_header(t={**F16_2x2, "shape": [2, -2]}), bytes(8)), "non-negative"),
        (raw_blob(good_header(t={**F16_2x2, "shape": [2, True]}), bytes(8)), "non-negative"),
        (raw_blob(good_header(t={**F16_2x2, "shape": "2x2"}), bytes(8)), "non-negative"),
        (raw_blob(good_header(t={**F16_2x2, "data_offsets": [0]}), bytes(8)), "[begin, end]"),
        (raw_blob(good_header(t={**F16_2x2, "shape": [2, 3]}), bytes(8)), "takes 12 bytes"),
        (raw_blob(good_header(t={**F16_2x2, "data_offsets": [4, 12]}), bytes(12)), "gap"),
        (
            raw_blob(good_header(a=F16_2x2, b={**F16_2x2, "data_offsets": [4, 12]}), bytes(12)),
            "overlaps",
        ),
        (raw_blob(good_header(t=F16_2x2), bytes(4)), "cover 8 bytes"),
        (raw_blob(good_header(t=F16_2x2), bytes(9)), "holds 9 bytes"),
        (raw_blob({"t": F16_2x2}, bytes(8)), "__metadata__ must be a map"),
        (raw_blob({"__metadata__": {"memory_id": 5}}), "map of strings to strings"),
        (raw_blob({"__metadata__": {"memory_id": MID}}), "lacks lmcache_svc.memory_format"),
    ],
)
def test_bad_safetensors_is_refused_naming_the_problem(blob: bytes, fragment: str) -> None:
    with pytest.raises(BadMemory) as caught:
        parse_memory(blob)
    assert fragment in str(caught.value)


def meta_with(**changes: str) -> dict[str, str]:
    return {**memory_metadata(MID), **changes}


@pytest.mark.parametrize(
    ("metadata", "fragment"),
    [
        (meta_with(**{"lmcache_svc.memory_format": "2"}), "this server reads '1'"),
        (meta_with(model=""), "model must name the model"),
        (meta_with(metadata="{not json"), "metadata is not JSON"),
        (meta_with(metadata="[1, 2]"), "must be a JSON object"),
        (meta_with(memory_id=MID.upper()), "canonical lowercase UUID"),
        (meta_with(memory_id=MID.replace("-", "")), "canonical lowercase UUID"),
        (meta_with(memory_id="../../etc/passwd"), "canonical lowercase UUID"),
    ],
)
def test_bad_metadata_is_refused(metadata: dict[str, str], fragment: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_memory(safetensors_bytes(default_tensors(), metadata))
    assert fragment in str(caught.value)


def test_memory_ids_must_be_canonical() -> None:
    fresh = str(uuid.uuid4())
    assert check_memory_id(fresh) == fresh
    for bad in ("", "x", "{" + fresh + "}", "urn:uuid:" + fresh, fresh + "\n"):
        with pytest.raises(InvalidArgument, match="canonical lowercase UUID"):
            check_memory_id(bad)


# -- bounded parsing: hostile headers are BadMemory (400 / INVALID_ARGUMENT), never a crash --


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        (b'{"t": {"dtype": "F16", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 8]}}',
         "integer of 5000 digits"),
        (b'{"x": ' + deep(100_000) + b"}", "nested too deeply"),
        (b'{"t": {"dtype": "F16", "shape": [NaN], "data_offsets": [0, 8]}}', "NaN"),
        (b'{"t": {"dtype": "F16", "shape": [1e999], "data_offsets": [0, 8]}}', "1e999"),
    ],
)  # fmt: skip
def test_hostile_json_in_the_header_is_bad_memory(header: bytes, fragment: str) -> None:
    with pytest.raises(BadMemory) as caught:
        parse_memory(raw_blob(header, bytes(8)))
    assert fragment in str(caught.value)


def test_a_header_over_the_limit_is_refused_before_it_is_parsed() -> None:
    from lmcache_svc.memory_blob import MAX_HEADER_BYTES

    garbage = b"\xff" * (MAX_HEADER_BYTES + 1)  # not even UTF-8: never decoded or parsed
    with pytest.raises(BadMemory, match=f"limit {MAX_HEADER_BYTES}"):
        parse_memory(raw_blob(garbage))
    prefix_only = struct.pack("<Q", MAX_HEADER_BYTES + 1)  # the prefix alone decides
    with pytest.raises(BadMemory, match=f"limit {MAX_HEADER_BYTES}"):
        parse_header(prefix_only, 1 << 30)


def test_more_tensors_than_a_model_has_are_refused() -> None:
    from lmcache_svc.memory_blob import MAX_TENSORS

    tensors = {f"t{i}": tensor([1], dtype="U8") for i in range(MAX_TENSORS + 1)}
    with pytest.raises(BadMemory, match=f"{MAX_TENSORS + 1} tensors; at most {MAX_TENSORS}"):
        parse_memory(safetensors_bytes(tensors, memory_metadata(MID)))
    tensors.pop("t0")  # exactly the limit: fine
    assert parse_memory(safetensors_bytes(tensors, memory_metadata(MID))).memory_id == MID


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ('{"score": NaN}', "NaN"),
        ('{"score": Infinity}', "Infinity"),
        ('{"score": -Infinity}', "-Infinity"),
        ('{"score": 1e400}', "1e400"),
        ('{"n": ' + "7" * 5000 + "}", "integer of 5000 digits"),
        ('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ],
)
def test_item_metadata_must_be_standard_json(raw: str, fragment: str) -> None:
    with pytest.raises(BadMemory) as caught:
        parse_memory(safetensors_bytes(default_tensors(), meta_with(metadata=raw)))
    assert fragment in str(caught.value)


def test_nesting_is_bounded_before_the_json_is_decoded() -> None:
    """``MAX_DEPTH`` levels of item metadata are read; one more is refused without the
    decoder (it recursed up to the interpreter's limit before); brackets inside strings,
    escaped quotes included, do not count."""
    at_limit = '{"x": ' + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "}"
    parse_memory(safetensors_bytes(default_tensors(), meta_with(metadata=at_limit)))
    over = '{"x": ' + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "}"
    with pytest.raises(BadMemory, match=f"nested too deeply \\(more than {MAX_DEPTH} levels\\)"):
        parse_memory(safetensors_bytes(default_tensors(), meta_with(metadata=over)))
    assert json_depth('{"a": [1, {"b": "[[{\\"[["}]}') == 3
    assert json_depth("7") == 0 and json_depth('"]]]"') == 0

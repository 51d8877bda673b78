"""Keys: golden vectors pin the exact bytes; keys never depend on the process."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from lmcache_svc.errors import InvalidArgument
from lmcache_svc.keys import (
    KVLayout,
    Namespace,
    chunk_hash,
    chunk_hashes,
    make_chunk_key,
    make_chunk_keys,
    pack_token_ids,
    parse_chunk_hash,
    parse_namespace_id,
)
from tests.helpers import make_namespace

GOLDEN_LAYOUT = KVLayout("bfloat16", 4, 2, 64, 128, "vllm-cpu/HNC")  # layers, kv heads, head, block


def golden_namespace(**overrides: object) -> Namespace:
    """The namespace of the golden vectors below, with ``overrides`` for its fields."""
    fields: dict[str, object] = {"model": "tiny-llama", "layout": GOLDEN_LAYOUT, "chunk_size": 4}
    return make_namespace(**{**fields, **overrides})  # type: ignore[arg-type]


GOLDEN_NAMESPACE_ID = "a5dcedf46c5f7fcd9ed5427b36a3f064"
GOLDEN_HASHES = [
    "c445d7c50b7ec3083b298663d03deeb73f35884f4624995554b8dee17aeb8d1f",
    "7f78661d6d5e2d6a69d138ecd8988b4b9193e7437ea5792868202a359a32e58b",
]
GOLDEN_PARTIAL = "0894a6a6396e81cfbf5b825ba49a84b63fed342844a81a263b121e301e8f0d65"


def test_golden_namespace_id_and_canonical_bytes() -> None:
    ns = golden_namespace()
    assert ns.canonical_bytes() == (
        b'{"chunk_size":4,"key_version":1,"layout":{"block_size":128,"dtype":"bfloat16",'
        b'"head_size":64,"kv_planes":2,"num_kv_heads":2,"num_layers":4,'
        b'"page_layout":"vllm-cpu/HNC"},"model":"tiny-llama","tenant":"default",'
        b'"tp_rank":0,"tp_size":1}'
    )
    assert ns.namespace_id.hex() == GOLDEN_NAMESPACE_ID
    assert ns.chunk_bytes == 4 * 4 * 2 * 2 * 64 * 2


def test_golden_chunk_hashes() -> None:
    ns = golden_namespace()
    assert [h.hex() for h in chunk_hashes(ns, list(range(10)))] == GOLDEN_HASHES
    with_partial = chunk_hashes(ns, list(range(10)), include_partial=True)
    assert [h.hex() for h in with_partial] == [*GOLDEN_HASHES, GOLDEN_PARTIAL]


def test_chain_matches_the_documented_formula() -> None:
    ns = golden_namespace()
    seed = b"lmcache-svc/chunk/v1\x00"
    first = hashlib.sha256(seed + ns.namespace_id + np.arange(4, dtype="<u4").tobytes()).digest()
    second = hashlib.sha256(seed + first + np.arange(4, 8, dtype="<u4").tobytes()).digest()
    assert chunk_hashes(ns, range(8)) == [first, second]
    assert chunk_hash(first, [4, 5, 6, 7]) == second


def test_token_ids_are_little_endian_uint32() -> None:
    assert pack_token_ids([1, 256, 2**32 - 1]) == b"\x01\0\0\0\0\x01\0\0\xff\xff\xff\xff"


def test_same_tokens_same_keys_in_any_container() -> None:
    ns = golden_namespace()
    tokens = list(range(100, 120))
    expected = chunk_hashes(ns, tokens)
    assert chunk_hashes(ns, tuple(tokens)) == expected
    assert chunk_hashes(ns, np.array(tokens, dtype=np.int64)) == expected
    assert chunk_hashes(ns, np.array(tokens, dtype=np.uint32)) == expected
    assert chunk_hashes(ns, [np.int64(t) for t in tokens]) == expected  # numpy ints in a list
    big = [2**32 - 1 - t for t in range(40)]  # lists pack without numpy: the same bytes
    assert pack_token_ids(big) == np.array(big, dtype="<u4").tobytes()


def test_keys_do_not_depend_on_python_hash_seed() -> None:
    code = (
        "from tests.test_keys import golden_namespace; from lmcache_svc.keys import chunk_hashes;"
        "print(chunk_hashes(golden_namespace(), list(range(10)))[1].hex())"
    )
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
            check=True,
        )
        assert out.stdout.strip() == GOLDEN_HASHES[1]


def test_every_namespace_field_changes_the_keys() -> None:
    base = golden_namespace()
    layout = base.layout
    variants = [
        golden_namespace(model="other"),
        golden_namespace(tenant="tenant-b"),
        golden_namespace(tp_rank=1, tp_size=2),
        golden_namespace(chunk_size=8),
        golden_namespace(layout=KVLayout("float16", 4, 2, 64, 128, "vllm-cpu/HNC")),
        golden_namespace(layout=KVLayout("bfloat16", 4, 2, 64, 16, "vllm-cuda/NHC")),
        golden_namespace(layout=KVLayout("bfloat16", 4, 2, 64, 128, "vllm-cpu/HNC", kv_planes=1)),
    ]
    ids = {v.namespace_id for v in variants} | {base.namespace_id}
    assert len(ids) == len(variants) + 1
    first = {chunk_hashes(v, range(8))[0] for v in variants}
    assert chunk_hashes(base, range(8))[0] not in first
    assert layout.bytes_per_token == 2 * 4 * 2 * 64 * 2


def test_prefix_property() -> None:
    ns = golden_namespace()
    a = chunk_hashes(ns, list(range(12)))
    b = chunk_hashes(ns, list(range(8)) + [99, 98, 97, 96])
    assert a[:2] == b[:2] and a[2] != b[2]


@pytest.mark.parametrize(
    "tokens", [[-1], [2**32], [1.5], [[1, 2]], [5, -1], [5, 2**40], [3, 2.0], [True, False]]
)
def test_bad_token_ids_are_rejected(tokens: list) -> None:
    with pytest.raises(InvalidArgument):
        chunk_hashes(golden_namespace(), tokens)


@pytest.mark.parametrize(
    "overrides",
    [
        {"model": ""},
        {"chunk_size": 0},
        {"tp_rank": 2, "tp_size": 2},
        {"tenant": ""},
        {"key_version": 2},
        {"layout": KVLayout("int4", 1, 1, 1, 1, "x")},
        {"layout": KVLayout("bfloat16", 0, 1, 1, 1, "x")},
    ],
)
def test_bad_namespaces_are_rejected(overrides: dict) -> None:
    with pytest.raises(InvalidArgument):
        golden_namespace(**overrides)


def test_namespace_dict_round_trip_and_errors() -> None:
    ns = golden_namespace(tenant="t1")
    assert Namespace.from_dict(ns.to_dict()) == ns
    broken = ns.to_dict()
    del broken["model"]
    with pytest.raises(InvalidArgument, match="model"):
        Namespace.from_dict(broken)
    with pytest.raises(InvalidArgument):
        Namespace.from_dict({**ns.to_dict(), "colour": "blue"})


def test_hex_parsing() -> None:
    assert parse_chunk_hash(GOLDEN_HASHES[0]).hex() == GOLDEN_HASHES[0]
    assert parse_namespace_id(GOLDEN_NAMESPACE_ID.upper()).hex() == GOLDEN_NAMESPACE_ID
    for bad in ("", "zz" * 32, GOLDEN_HASHES[0][:-1], GOLDEN_HASHES[0] + "00"):
        with pytest.raises(InvalidArgument, match="chunk hash"):
            parse_chunk_hash(bad)


def test_make_chunk_keys_matches_make_chunk_key_and_checks_every_hash() -> None:
    ns_id = bytes(range(16))
    hashes = [bytes([i]) * 32 for i in range(3)]

    assert make_chunk_keys(ns_id, hashes) == [make_chunk_key(ns_id, h) for h in hashes]
    assert make_chunk_keys(ns_id, [bytearray(hashes[0])]) == [make_chunk_key(ns_id, hashes[0])]
    with pytest.raises(InvalidArgument, match="got 31"):
        make_chunk_keys(ns_id, [hashes[0], b"x" * 31])

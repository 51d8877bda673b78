"""The server's own encoding of ``BlockStored`` (``StoredWire``: token ids straight from the
packed bytes) decodes to the same event as ``BlockStored`` would (vLLM's classes read it the
same way: they declare the same fields, see ``format.py``)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from lmcache_svc.server.events.format import (
    BlockStored,
    StoredWire,
    decode_batch,
    encode_batch,
    token_ids_raw,
)

MAX_HASH = 2**64 - 1


@pytest.mark.parametrize("num_tokens", [0, 1, 15, 16, 256, 65535, 65536])
def test_token_ids_decode_as_the_same_ints_at_every_array_size(num_tokens: int) -> None:
    ids = np.random.default_rng(num_tokens).integers(0, 2**32, num_tokens, dtype=np.uint64)
    packed = ids.astype("<u4").tobytes()
    assert msgspec.msgpack.decode(token_ids_raw(packed)) == ids.tolist()


@pytest.mark.parametrize("locality", ["LOCAL", "REMOTE", None])
@pytest.mark.parametrize("parent", [None, 0, MAX_HASH])
def test_an_encoded_store_decodes_to_its_block_stored(locality: str | None, parent) -> None:
    tokens = np.random.default_rng(1).integers(0, 2**32, 64, dtype=np.uint64)
    raw = StoredWire(
        block_hashes=[1, MAX_HASH],
        parent_block_hash=parent,
        token_ids=token_ids_raw(tokens.astype("<u4").tobytes()),
        block_size=16,
        lora_id=None,
        medium="CPU",
        lora_name=None,
        locality=locality,
    )
    (event,) = decode_batch(encode_batch(1.5, [raw])).events
    expected = BlockStored([1, MAX_HASH], parent, tokens.tolist(), 16, None, "CPU", None)
    expected.locality = locality
    assert event == expected
    as_struct = msgspec.msgpack.encode(expected)  # the same bytes but for the token ids' form
    assert len(msgspec.msgpack.encode(raw)) - len(as_struct) == sum(
        5 - len(msgspec.msgpack.encode(t)) for t in tokens.tolist()
    )

"""What a save tells the server about its chunks: tokens and parents that hash to them."""

from __future__ import annotations

import random

from lmcache_svc_vllm.metadata import SavePlan
from lmcache_svc_vllm.save_tokens import describe_save, describe_saves

from lmcache_svc.keys import chunk_hash, chunk_hashes, pack_token_ids
from tests.helpers import make_namespace

NS = [make_namespace(chunk_size=32, tp_size=2, tp_rank=r) for r in range(2)]


def test_each_described_chunk_hashes_to_its_key_on_every_rank() -> None:
    tokens = [random.Random(1).randrange(50_000) for _ in range(5 * 32 + 7)]
    hashes = tuple(tuple(chunk_hashes(ns, tokens)) for ns in NS)
    token_bytes, parents = describe_save(pack_token_ids(tokens), hashes, 2, 5, 32)  # chunks 2..4
    assert parents == (hashes[0][1], hashes[1][1])
    save = SavePlan("r", tuple(h[2:5] for h in hashes), (), token_bytes, parents)
    for rank in range(len(NS)):
        described = describe_saves([save], rank, 32)
        assert described is not None
        packed, parent_hashes = described.for_chunks(hashes[rank][2:5])
        for i, h in enumerate(hashes[rank][2:5]):
            part = packed[i * 128 : (i + 1) * 128]
            assert chunk_hash(parent_hashes[i], memoryview(part).cast("I")) == h


def test_a_save_without_tokens_describes_nothing() -> None:
    save = SavePlan("r", ((b"\1" * 32,),), (1,))
    assert describe_saves([save], 0, 32) is None

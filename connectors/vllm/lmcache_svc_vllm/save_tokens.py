"""What a save tells the server about its chunks, for the server's KV events (docs/events.md):
each chunk's token ids and the hash of the chunk before it. The scheduler half puts them in
the ``SavePlan`` when the server publishes the namespace; the worker half sends them with
its commit. No vLLM import: the unit tests run this without vLLM."""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_svc.client.events import ChunkTokens
from lmcache_svc_vllm.metadata import SavePlan


def describe_save(
    packed_tokens: bytes, hashes: Sequence[Sequence[bytes]], start: int, end: int, chunk: int
) -> tuple[bytes, tuple[bytes, ...]]:
    """``SavePlan.token_ids`` and ``parent_hashes`` for chunks ``[start, end)``, from the
    prompt's token ids packed as ``keys.pack_token_ids`` does (little-endian uint32)."""
    tokens = packed_tokens[4 * start * chunk : 4 * end * chunk]
    return tokens, tuple(h[start - 1] if start else b"" for h in hashes)


def describe_saves(saves: Sequence[SavePlan], tp_rank: int, chunk: int) -> ChunkTokens | None:
    """What the worker of ``tp_rank`` tells the server about the chunks it commits."""
    out = ChunkTokens()
    step = 4 * chunk
    for save in saves:
        if not save.token_ids:
            continue
        hashes = save.hashes_for(tp_rank)
        parent = save.parent_hashes[tp_rank]
        for i, h in enumerate(hashes):
            out.add(h, hashes[i - 1] if i else parent, save.token_ids[i * step : (i + 1) * step])
    return out if out.items else None

"""What an event needs to say about a chunk beyond its key: its token ids and its parent.

A store request may carry each chunk's token ids and the hash of the chunk before it
(``CommitStore.token_ids`` / ``parent_hashes``). The server checks them against the chunk
hash itself (``keys.chunk_hash``: the hash *is* sha256 over the parent and the tokens), so a
client can only describe a chunk truthfully, then keeps them here while events are on.

Memory: one ``ChunkMeta`` per described chunk, the tokens as packed little-endian uint32
(``4 * chunk_size`` bytes: 512 for 128-token chunks) plus the 32-byte parent hash and the
dict entry, at most ``max_chunks`` of them, least recently described dropped first (a
dropped chunk is still removed correctly; it is no longer announced again if it later
moves to another tier).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from lmcache_svc.errors import InvalidArgument
from lmcache_svc.keys import (
    NAMESPACE_ID_BYTES,
    ChunkKey,
    Namespace,
    chunk_hash_packed,
    make_chunk_key,
)
from lmcache_svc.tiers.base import ChunkDescription

ChunkMeta = ChunkDescription
"""A chunk's parent and token ids (the SSD and Redis tiers store the same with the value)."""


def describe_chunks(
    namespace: Namespace,
    chunk_hashes: Sequence[bytes],
    token_ids: bytes,
    parent_hashes: Sequence[bytes],
) -> list[ChunkMeta]:
    """Each chunk's ``ChunkMeta`` from a store request's fields, checked against its hash.

    ``token_ids``: ``chunk_size`` little-endian uint32 per chunk, in order;
    ``parent_hashes``: one per chunk, empty for a sequence's first chunk. A mismatch is the
    caller's error (``InvalidArgument`` naming the chunk)."""
    size = namespace.chunk_size
    if len(token_ids) != 4 * size * len(chunk_hashes):
        raise InvalidArgument(
            f"token_ids holds {len(token_ids)} bytes; {len(chunk_hashes)} chunks of "
            f"{size} tokens need {4 * size * len(chunk_hashes)} (little-endian uint32)"
        )
    if len(parent_hashes) != len(chunk_hashes):
        raise InvalidArgument(
            f"{len(parent_hashes)} parent_hashes for {len(chunk_hashes)} chunk hashes"
        )
    out: list[ChunkMeta] = []
    step = 4 * size
    for i, (h, parent) in enumerate(zip(chunk_hashes, parent_hashes)):
        parent = bytes(parent) or namespace.namespace_id
        tokens = bytes(token_ids[i * step : (i + 1) * step])
        if chunk_hash_packed(parent, tokens) != bytes(h):
            raise InvalidArgument(
                f"chunk {bytes(h).hex()}: its token_ids and parent hash do not hash to it"
            )
        out.append(ChunkMeta(parent, tokens))
    return out


class MetaStore:
    """Chunk key -> ``ChunkMeta``, bounded (least recently described dropped first).
    Thread-safe."""

    def __init__(self, max_chunks: int) -> None:
        self._max = max_chunks
        self._items: OrderedDict[ChunkKey, ChunkMeta] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: ChunkKey, meta: ChunkMeta) -> None:
        with self._lock:
            self._items[key] = meta
            self._items.move_to_end(key)
            while len(self._items) > self._max:
                self._items.popitem(last=False)

    def get(self, key: ChunkKey) -> ChunkMeta | None:
        return self._items.get(key)


def parent_key(key: ChunkKey, meta: ChunkMeta) -> ChunkKey | None:
    """The parent chunk's key, or None for a sequence's first chunk."""
    ns_id = key[:NAMESPACE_ID_BYTES]
    if meta.parent == ns_id:
        return None
    return make_chunk_key(ns_id, meta.parent)

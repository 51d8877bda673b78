"""A chunk's description as the SSD and Redis tiers store it with the value: its token ids
and its parent, so a restarted server (or another server sharing the Redis) can announce
the chunk in its KV events (``docs/events.md``).

Layout (little-endian), written right after a value's fixed header when the store carried
the description (``Tier.describe``), never otherwise: ``DESCRIPTION`` (number of tokens
u32, parent length u8, parent zero-padded to 32 bytes), then the token ids as packed u32.
The parent is the previous chunk's 32-byte hash, or for a sequence's first chunk the
16-byte namespace id (the key's first 16 bytes). No checksum: a reader checks the
description against the chunk hash (sha256 over parent and tokens, ``keys.py``) before
using it, so a damaged one can only be refused, never believed.
"""

from __future__ import annotations

import struct

from lmcache_svc.keys import CHUNK_HASH_BYTES, NAMESPACE_ID_BYTES, ChunkKey
from lmcache_svc.tiers.base import ChunkDescription

DESCRIPTION = struct.Struct("<IB32s")
"""number of tokens, parent length, parent (zero-padded)."""
TOKEN_BYTES = 4


def pack_description(desc: ChunkDescription) -> bytes:
    """The description's bytes (``DESCRIPTION`` then the tokens)."""
    num_tokens = len(desc.tokens) // TOKEN_BYTES
    return DESCRIPTION.pack(num_tokens, len(desc.parent), desc.parent) + desc.tokens


def described_size(desc: ChunkDescription) -> int:
    return DESCRIPTION.size + len(desc.tokens)


def description_tokens(raw: bytes | memoryview, max_tokens: int) -> int:
    """The number of tokens a description's fixed part announces; ``ValueError`` when it is
    over ``max_tokens``, or the part is truncated."""
    if len(raw) < DESCRIPTION.size:
        raise ValueError(f"truncated description ({len(raw)} of {DESCRIPTION.size} bytes)")
    num_tokens = DESCRIPTION.unpack_from(raw)[0]
    if num_tokens > max_tokens:
        raise ValueError(f"description announces {num_tokens} tokens, at most {max_tokens} fit")
    return int(num_tokens)


def unpack_description(
    raw: bytes | memoryview, key: ChunkKey, max_tokens: int
) -> ChunkDescription | None:
    """The description at the start of ``raw`` (None when it holds no tokens: a value
    written without one); ``ValueError`` saying what is wrong with a damaged one."""
    num_tokens = description_tokens(raw, max_tokens)
    _, parent_len, parent = DESCRIPTION.unpack_from(raw)
    if num_tokens == 0:
        return None
    end = DESCRIPTION.size + TOKEN_BYTES * num_tokens
    if len(raw) < end:
        raise ValueError(f"description of {num_tokens} tokens truncated at {len(raw)} bytes")
    if parent_len == NAMESPACE_ID_BYTES:
        if parent[:NAMESPACE_ID_BYTES] != key[:NAMESPACE_ID_BYTES]:
            raise ValueError("description's first-chunk parent is not the key's namespace")
    elif parent_len != CHUNK_HASH_BYTES:
        raise ValueError(f"description's parent is {parent_len} bytes (16 or 32)")
    return ChunkDescription(bytes(parent[:parent_len]), bytes(raw[DESCRIPTION.size : end]))

"""The SSD tier's chunk file format (see ``tiers/ssd.py`` for how files are written).

A chunk file is named ``<96-hex ChunkKey>.kv``. It is a 4096-byte header block, then the
payload at offset 4096 so O_DIRECT transfers stay aligned; with O_DIRECT the file is
zero-padded to a multiple of 4096. The header (``HEADER``, little-endian) holds a magic, the
format version, the payload length, the xxh3-64 checksum of the payload and the ChunkKey, so
truncated, overwritten or renamed files are detected.

Versions: 1, the header alone (the rest of the block zeros): a chunk stored without its
description (events off), and every file written before descriptions were stored; 2, the
header followed by the chunk's description (``described.py``: token ids and parent,
37 + 4 * tokens bytes) inside the same block, so reading it costs no more than reading the
header and the payload stays at offset 4096. A description that does not fit in the block
(over ``MAX_TOKENS`` tokens) is not stored (the file is written as version 1).
"""

from __future__ import annotations

import re
import struct

import xxhash

from lmcache_svc.keys import CHUNK_KEY_BYTES, ChunkKey
from lmcache_svc.tiers._fileio import DIRECT_ALIGN, align_up
from lmcache_svc.tiers.base import ChunkDescription
from lmcache_svc.tiers.described import (
    DESCRIPTION,
    TOKEN_BYTES,
    described_size,
    pack_description,
    unpack_description,
)

MAGIC = b"LMCSVCS1"
PLAIN_VERSION = 1
"""The header alone."""
DESCRIBED_VERSION = 2
"""The header, then the chunk's description."""
BLOCK = DIRECT_ALIGN
"""Header block size, payload offset and O_DIRECT alignment."""
HEADER = struct.Struct("<8sHQQ48s")
"""magic, format version, payload length, xxh3_64 of the payload, ChunkKey."""
MAX_TOKENS = (BLOCK - HEADER.size - DESCRIPTION.size) // TOKEN_BYTES
"""Tokens of the largest description the header block holds (996)."""

_NAME_RE = re.compile(rf"[0-9a-f]{{{2 * CHUNK_KEY_BYTES}}}\.kv")


def key_from_name(shard: str, name: str) -> ChunkKey | None:
    """The ChunkKey a file in shard directory ``shard`` is named for, or ``None``."""
    if not _NAME_RE.fullmatch(name) or not name.startswith(shard):
        return None
    return ChunkKey(bytes.fromhex(name[: 2 * CHUNK_KEY_BYTES]))


def pack_header(key: ChunkKey, payload: memoryview, desc: ChunkDescription | None = None) -> bytes:
    """The whole header block (``BLOCK`` bytes) for ``payload`` stored under ``key``, with
    the chunk's description when given and it fits."""
    checksum = xxhash.xxh3_64_intdigest(payload)
    if desc is None or HEADER.size + described_size(desc) > BLOCK:
        packed = HEADER.pack(MAGIC, PLAIN_VERSION, len(payload), checksum, key)
    else:
        packed = HEADER.pack(MAGIC, DESCRIBED_VERSION, len(payload), checksum, key)
        packed += pack_description(desc)
    return packed + bytes(BLOCK - len(packed))


def parse_header(raw: bytes, key: ChunkKey, file_size: int) -> tuple[int, int]:
    """(payload length, checksum) from a header; ValueError saying what is wrong."""
    if len(raw) < HEADER.size:
        raise ValueError(f"truncated header ({file_size} bytes)")
    magic, version, length, checksum, stored_key = HEADER.unpack(raw[: HEADER.size])
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r}")
    if version not in (PLAIN_VERSION, DESCRIBED_VERSION):
        raise ValueError(f"unsupported format version {version}")
    if stored_key != key:
        raise ValueError(f"header names chunk {stored_key.hex()}, not the file's name")
    if file_size not in (BLOCK + length, align_up(BLOCK + length)):
        raise ValueError(f"file size {file_size} does not match payload length {length}")
    return length, checksum


def parse_description(raw: bytes, key: ChunkKey) -> ChunkDescription | None:
    """The description in a header block (``raw``, the block's first bytes, already checked
    by ``parse_header``): None for version 1; ``ValueError`` saying what is wrong."""
    if HEADER.unpack_from(raw)[1] != DESCRIBED_VERSION:
        return None
    return unpack_description(memoryview(raw)[HEADER.size :], key, MAX_TOKENS)

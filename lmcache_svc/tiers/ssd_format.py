"""The SSD tier's chunk file format (see ``tiers/ssd.py`` for how files are written).

A chunk file is named ``<96-hex ChunkKey>.kv``. It is a 4096-byte header block, then the
payload at offset 4096 so O_DIRECT transfers stay aligned; with O_DIRECT the file is
zero-padded to a multiple of 4096. The header (``HEADER``, little-endian) holds a magic, the
format version, the payload length, the xxh3-64 checksum of the payload and the ChunkKey, so
truncated, overwritten or renamed files are detected.
"""

from __future__ import annotations

import re
import struct

import xxhash

from lmcache_svc.keys import CHUNK_KEY_BYTES, ChunkKey
from lmcache_svc.tiers._fileio import DIRECT_ALIGN, align_up

MAGIC = b"LMCSVCS1"
FORMAT_VERSION = 1
BLOCK = DIRECT_ALIGN
"""Header block size, payload offset and O_DIRECT alignment."""
HEADER = struct.Struct("<8sHQQ48s")
"""magic, format version, payload length, xxh3_64 of the payload, ChunkKey."""

_NAME_RE = re.compile(rf"[0-9a-f]{{{2 * CHUNK_KEY_BYTES}}}\.kv")


def key_from_name(shard: str, name: str) -> ChunkKey | None:
    """The ChunkKey a file in shard directory ``shard`` is named for, or ``None``."""
    if not _NAME_RE.fullmatch(name) or not name.startswith(shard):
        return None
    return ChunkKey(bytes.fromhex(name[: 2 * CHUNK_KEY_BYTES]))


def pack_header(key: ChunkKey, payload: memoryview) -> bytes:
    """The whole header block (``BLOCK`` bytes) for ``payload`` stored under ``key``."""
    checksum = xxhash.xxh3_64_intdigest(payload)
    packed = HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), checksum, key)
    return packed + bytes(BLOCK - HEADER.size)


def parse_header(raw: bytes, key: ChunkKey, file_size: int) -> tuple[int, int]:
    """(payload length, checksum) from a header; ValueError saying what is wrong."""
    if len(raw) < HEADER.size:
        raise ValueError(f"truncated header ({file_size} bytes)")
    magic, version, length, checksum, stored_key = HEADER.unpack(raw[: HEADER.size])
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise ValueError(f"unsupported format version {version}")
    if stored_key != key:
        raise ValueError(f"header names chunk {stored_key.hex()}, not the file's name")
    if file_size not in (BLOCK + length, align_up(BLOCK + length)):
        raise ValueError(f"file size {file_size} does not match payload length {length}")
    return length, checksum

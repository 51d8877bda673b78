"""Namespaces and chained chunk keys.

A *namespace* says what stored bytes mean: which model produced them, how a KV page is laid
out, which tensor-parallel rank holds them and which tenant owns them. A *chunk hash* names
the KV bytes of one chunk of tokens inside a namespace: it is a chained hash,
``sha256(seed || parent_hash || token_ids)``, whose root parent is the namespace id, so the
same prefix in two namespaces never shares a key.

Everything here is a pure function of its arguments: canonical bytes (little-endian uint32
token ids, sorted-key JSON for namespaces) and a fixed, versioned seed make keys identical
across processes, hosts and Python hash seeds. Golden vectors in ``tests/test_keys.py`` pin
the exact bytes; changing anything here requires a new ``KEY_FORMAT_VERSION``.

This module needs only the standard library and numpy, so engine-side clients can import it
without the server's dependencies.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, NewType, cast

import numpy as np

from lmcache_svc.errors import InvalidArgument

KEY_FORMAT_VERSION = 1
DEFAULT_CHUNK_SIZE = 256

CHUNK_HASH_BYTES = 32
NAMESPACE_ID_BYTES = 16

ChunkHash = NewType("ChunkHash", bytes)
"""32-byte sha256 digest naming one chunk of tokens inside a namespace."""

NamespaceId = NewType("NamespaceId", bytes)
"""16-byte digest of a namespace's canonical bytes."""

ChunkKey = NewType("ChunkKey", bytes)
"""A chunk's full storage key: namespace id (16 bytes) followed by its chunk hash (32 bytes)."""

CHUNK_KEY_BYTES = NAMESPACE_ID_BYTES + CHUNK_HASH_BYTES

_CHUNK_SEED = b"lmcache-svc/chunk/v1\x00"
_NAMESPACE_SEED = b"lmcache-svc/namespace/v1\x00"
_SEEDED = hashlib.sha256(_CHUNK_SEED)
"""The hash state after the seed, never updated: every chunk hash starts from a ``copy()``
(a prompt's 47 chunks hashed 85 -> 68 us)."""
_MAX_TOKEN_ID = 2**32 - 1
MAX_FIELD_VALUE = 2**32 - 1
"""Largest value of a namespace's integer fields: they travel as protobuf ``uint32``."""
MAX_CHUNK_BYTES = 4 << 30
"""Largest ``chunk_bytes`` of any namespace (a server may allow less: ``max_body_bytes``)."""
_HEX_RE = re.compile(r"^[0-9a-f]*$")

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def documented(
    *, minimum: int | None = None, description: str | None = None, examples: list[str] | None = None
) -> dict[str, Any]:
    """A namespace field's contract, in its dataclass metadata: ``validate`` enforces
    ``minimum`` (up to ``MAX_FIELD_VALUE``); the REST models (``server/http/models.py``) are
    generated from the same fields and document all three."""
    return {"minimum": minimum, "description": description, "examples": examples}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How one rank's KV bytes are laid out; two layouts with equal fields share pages.

    ``num_kv_heads`` counts the heads this rank holds (after tensor-parallel sharding).
    ``page_layout`` is an opaque label for the byte order inside a page, e.g.
    ``"vllm-cpu/NHC"``; pages are only ever restored into an identical layout.
    ``kv_planes`` is 2 for separate K and V, 1 for a single latent (MLA).
    """

    dtype: str = field(metadata=documented(examples=["bfloat16"]))
    num_layers: int = field(metadata=documented(minimum=1))
    num_kv_heads: int = field(
        metadata=documented(minimum=1, description="KV heads held by this tensor-parallel rank")
    )
    head_size: int = field(metadata=documented(minimum=1))
    block_size: int = field(metadata=documented(minimum=1))
    page_layout: str = field(metadata=documented(examples=["vllm-cpu/NHC"]))
    kv_planes: int = field(
        default=2, metadata=documented(description="2 for separate K and V, 1 for MLA")
    )

    def validate(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise InvalidArgument(
                f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPE_SIZES)}"
            )
        _require_bounded_fields(self, "layout.")
        if type(self.kv_planes) is not int or self.kv_planes not in (1, 2):
            raise InvalidArgument(f"kv_planes must be 1 or 2, got {self.kv_planes!r}")
        if not self.page_layout or len(self.page_layout) > 128:
            raise InvalidArgument("page_layout must be a non-empty label of at most 128 chars")

    @property
    def bytes_per_token(self) -> int:
        per_layer = self.kv_planes * self.num_kv_heads * self.head_size * DTYPE_SIZES[self.dtype]
        return self.num_layers * per_layer


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that decides what a chunk's bytes mean, hashed into every key."""

    model: str
    layout: KVLayout
    chunk_size: int = field(default=DEFAULT_CHUNK_SIZE, metadata=documented(minimum=1))
    tp_rank: int = field(default=0, metadata=documented(minimum=0))
    tp_size: int = field(default=1, metadata=documented(minimum=1))
    tenant: str = "default"
    key_version: int = KEY_FORMAT_VERSION
    _id: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()
        digest = hashlib.sha256(_NAMESPACE_SEED + self.canonical_bytes()).digest()
        object.__setattr__(self, "_id", digest[:NAMESPACE_ID_BYTES])

    def validate(self) -> None:
        if not isinstance(self.model, str) or not self.model or len(self.model) > 512:
            raise InvalidArgument("namespace model must be a non-empty string of at most 512 chars")
        if not isinstance(self.tenant, str) or not self.tenant or len(self.tenant) > 256:
            raise InvalidArgument(
                "namespace tenant must be a non-empty string of at most 256 chars"
            )
        if not isinstance(self.layout, KVLayout):
            raise InvalidArgument("namespace layout must be a KVLayout")
        self.layout.validate()
        _require_bounded_fields(self, "")
        if self.tp_rank >= self.tp_size:
            raise InvalidArgument(
                f"tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank!r}"
            )
        if self.key_version != KEY_FORMAT_VERSION:
            raise InvalidArgument(
                f"key_version {self.key_version!r} is not supported; this build speaks "
                f"version {KEY_FORMAT_VERSION}"
            )
        if self.chunk_bytes > MAX_CHUNK_BYTES:
            raise InvalidArgument(
                f"chunk_bytes (chunk_size {self.chunk_size} x {self.layout.bytes_per_token} "
                f"bytes per token) is {self.chunk_bytes}, over the limit of {MAX_CHUNK_BYTES}"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form: JSON/YAML friendly, and the input of ``canonical_bytes``."""
        return {
            "model": self.model,
            "layout": asdict(self.layout),
            "chunk_size": self.chunk_size,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "tenant": self.tenant,
            "key_version": self.key_version,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Namespace:
        """Build from ``to_dict``'s form, naming the field that is missing or wrong."""
        if not isinstance(data, dict):
            raise InvalidArgument("namespace must be an object")
        try:
            layout = KVLayout(**data["layout"])
            rest = {k: v for k, v in data.items() if k != "layout"}
            return cls(layout=layout, **rest)
        except KeyError as e:
            raise InvalidArgument(f"namespace is missing field {e.args[0]!r}") from None
        except TypeError as e:
            raise InvalidArgument(f"bad namespace: {e}") from None

    def canonical_bytes(self) -> bytes:
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return text.encode("ascii")

    @property
    def namespace_id(self) -> NamespaceId:
        return NamespaceId(self._id)

    @property
    def chunk_bytes(self) -> int:
        """Exact size of one full chunk's KV bytes in this namespace."""
        return self.chunk_size * self.layout.bytes_per_token


def _require_bounded_fields(obj: KVLayout | Namespace, prefix: str) -> None:
    """Each field of ``obj`` with a documented ``minimum`` is an integer in range."""
    for f in fields(obj):
        low = f.metadata.get("minimum")
        if low is not None:
            _require_field_int(prefix + f.name, getattr(obj, f.name), low)


def _require_field_int(name: str, value: object, low: int) -> None:
    """An integer field in ``[low, MAX_FIELD_VALUE]``, or ``InvalidArgument`` naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise InvalidArgument(f"{name} must be {what}, got {value!r:.80}")
    if value > MAX_FIELD_VALUE:
        raise InvalidArgument(f"{name} must be at most {MAX_FIELD_VALUE}, got {value}")


def pack_token_ids(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Canonical bytes of token ids: little-endian uint32, rejecting ids out of range."""
    if isinstance(token_ids, list):  # what engines hand over: packed without numpy, ~4x faster
        packed = _pack_list(token_ids)
        if packed is not None:
            return packed
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise InvalidArgument(f"token ids must be a flat sequence, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgument(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN_ID:
        raise InvalidArgument("token ids must be in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


_U32 = next((code for code in "IL" if array(code).itemsize == 4), None)
"""The ``array`` type code of an unsigned 32-bit integer here (None: numpy packs)."""


def _pack_list(token_ids: list[int]) -> bytes | None:
    """A list of ints packed by ``array``, which refuses values out of uint32's range; None
    for anything else (numpy then packs it, or names what is wrong)."""
    if _U32 is None or (token_ids and type(token_ids[0]) is bool):
        return None
    try:
        packed = array(_U32, token_ids)
    except (OverflowError, TypeError):
        return None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def chunk_hash(parent: bytes, token_ids: Sequence[int] | np.ndarray) -> ChunkHash:
    """Hash of one chunk given its parent (the previous chunk hash, or the namespace id)."""
    h = hashlib.sha256(_CHUNK_SEED)
    h.update(parent)
    h.update(pack_token_ids(token_ids))
    return ChunkHash(h.digest())


def chunk_hash_packed(parent: bytes, packed_token_ids: bytes) -> ChunkHash:
    """``chunk_hash`` of token ids already packed as ``pack_token_ids`` does (little-endian
    uint32), without unpacking them (the store path checks a chunk's tokens with it)."""
    h = _SEEDED.copy()
    h.update(parent)
    h.update(packed_token_ids)
    return ChunkHash(h.digest())


def chunk_hashes(
    namespace: Namespace,
    token_ids: Sequence[int] | np.ndarray,
    *,
    include_partial: bool = False,
) -> list[ChunkHash]:
    """Chained hashes of the consecutive chunks of ``token_ids`` in ``namespace``.

    Only full chunks get a hash unless ``include_partial`` is set: the server stores full
    chunks of exactly ``namespace.chunk_bytes``.
    """
    return chunk_hashes_packed(
        namespace, pack_token_ids(token_ids), include_partial=include_partial
    )


def chunk_hashes_packed(
    namespace: Namespace, packed_token_ids: bytes, *, include_partial: bool = False
) -> list[ChunkHash]:
    """``chunk_hashes`` of token ids already packed as ``pack_token_ids`` does."""
    size = namespace.chunk_size
    packed = memoryview(packed_token_ids)
    num_tokens = len(packed) // 4
    end = 4 * (num_tokens if include_partial else num_tokens - num_tokens % size)
    parent: bytes = namespace.namespace_id
    hashes: list[bytes] = []
    seeded, step = _SEEDED.copy, 4 * size  # bytes of a chunk's tokens
    for start in range(0, end, step):
        h = seeded()
        h.update(parent)
        h.update(packed[start : min(start + step, end)])
        parent = h.digest()
        hashes.append(parent)
    return cast("list[ChunkHash]", hashes)


def make_chunk_key(namespace_id: bytes, chunk_hash_: bytes) -> ChunkKey:
    return ChunkKey(bytes(namespace_id) + bytes(chunk_hash_))


def make_chunk_keys(namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> list[ChunkKey]:
    """Keys of raw chunk hashes from the wire, each checked like ``check_chunk_hash``."""
    prefix = bytes(namespace_id)
    keys = [prefix + h for h in chunk_hashes if type(h) is bytes and len(h) == CHUNK_HASH_BYTES]
    if len(keys) != len(chunk_hashes):  # something else in there: the slow path names it
        return [make_chunk_key(prefix, check_chunk_hash(h)) for h in chunk_hashes]
    return cast("list[ChunkKey]", keys)


def check_chunk_hash(value: bytes) -> ChunkHash:
    """Validate a raw chunk hash from the wire."""
    if not isinstance(value, (bytes, bytearray)) or len(value) != CHUNK_HASH_BYTES:
        size = len(value) if isinstance(value, (bytes, bytearray)) else type(value).__name__
        raise InvalidArgument(f"chunk hash must be {CHUNK_HASH_BYTES} bytes, got {size}")
    return ChunkHash(bytes(value))


def check_namespace_id(value: bytes) -> NamespaceId:
    if not isinstance(value, (bytes, bytearray)) or len(value) != NAMESPACE_ID_BYTES:
        size = len(value) if isinstance(value, (bytes, bytearray)) else type(value).__name__
        raise InvalidArgument(f"namespace id must be {NAMESPACE_ID_BYTES} bytes, got {size}")
    return NamespaceId(bytes(value))


def parse_hex(value: str, nbytes: int, what: str) -> bytes:
    """Parse lowercase/uppercase hex of exactly ``nbytes`` bytes, naming ``what`` on error."""
    if not isinstance(value, str) or len(value) != 2 * nbytes or not _HEX_RE.match(value.lower()):
        shown = value[:80] if isinstance(value, str) else type(value).__name__
        raise InvalidArgument(f"{what} must be {2 * nbytes} hex characters, got {shown!r}")
    return bytes.fromhex(value)


def parse_chunk_hash(value: str) -> ChunkHash:
    return ChunkHash(parse_hex(value, CHUNK_HASH_BYTES, "chunk hash"))


def parse_namespace_id(value: str) -> NamespaceId:
    return NamespaceId(parse_hex(value, NAMESPACE_ID_BYTES, "namespace id"))

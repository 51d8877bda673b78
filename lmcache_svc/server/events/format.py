"""KV events in vLLM 0.32's wire format (``vllm/distributed/kv_events.py``).

A batch is a msgpack array ``[ts, events, data_parallel_rank]`` (always three elements:
NVIDIA Dynamo's reader needs the third); each event is a msgpack map tagged by its class
name (``{"type": "BlockStored", ...}``). The structs below declare the same names, fields
and options as vLLM's, so vLLM's own ``msgspec`` decoder reads what we encode (tested with
vLLM's classes in ``tests/events``); the server does not depend on vLLM.

Block hashes are ints (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the low
64 bits of a hash, unsigned.

A ``BlockStored`` is sent as ``StoredWire``: the same tag and fields, its ``token_ids``
already msgpack (``token_ids_raw``: an array of uint32-format ints, 5 bytes per token,
built from the packed tokens in one numpy copy instead of a Python list of ints; msgpack
lets any int take a wider format than the smallest, and decoders, vLLM's ``msgspec`` one
among them, read it as the same list of ints).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import msgspec
import numpy as np

Medium = Literal["GPU", "CPU", "STORAGE"]
Locality = Literal["LOCAL", "REMOTE"]
HASH_MASK = (1 << 64) - 1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class StoredWire(KVCacheEvent, tag="BlockStored"):
    """How this server encodes a ``BlockStored``: ``token_ids`` is msgpack already
    (``token_ids_raw``); the other fields, and what a decoder reads, are ``BlockStored``'s."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    locality: str | None = None


_UINT32_ITEM = np.dtype([("marker", "u1"), ("value", ">u4")])
"""One msgpack uint32: the 0xce marker, then the value big-endian."""


def token_ids_raw(packed: bytes) -> msgspec.Raw:
    """Token ids packed as little-endian uint32 as a msgpack array of ints (each in the
    5-byte uint32 format)."""
    ids = np.frombuffer(packed, "<u4")
    n = len(ids)
    if n < 16:
        header = bytes([0x90 | n])
    elif n <= 0xFFFF:
        header = b"\xdc" + n.to_bytes(2, "big")
    else:
        header = b"\xdd" + n.to_bytes(4, "big")
    items = np.empty(n, _UINT32_ITEM)
    items["marker"] = 0xCE
    items["value"] = ids
    return msgspec.Raw(header + items.tobytes())


Event = BlockStored | StoredWire | BlockRemoved | AllBlocksCleared
Pending = Event | Callable[[], Event]
"""An event, or how to build it: the store path queues the cheap recipe, the publisher's
thread builds the event (token ids as msgpack, hashes) off that path."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(ts: float, events: list[Pending], dp_rank: int = 0) -> bytes:
    """The msgpack payload of one batch (``data_parallel_rank`` always set: three
    elements)."""
    built = [e if isinstance(e, KVCacheEvent) else e() for e in events]
    return _ENCODER.encode(EventBatch(ts=ts, events=built, data_parallel_rank=dp_rank))


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch back from its payload; ``msgspec.ValidationError``/``DecodeError`` if it is
    not one."""
    return _DECODER.decode(payload)


def seq_bytes(seq: int) -> bytes:
    """A frame's sequence number: 8 bytes, big-endian, signed (the end marker is -1)."""
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


END_SEQ = seq_bytes(-1)
"""The replay socket's end marker."""

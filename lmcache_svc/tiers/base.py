"""The tier contract.

A tier is a storage medium for chunk bytes, one object in the cache's ordered list (fastest
first). A tier enforces its own capacity (``put`` answers ``False`` rather than exceed it) but
knows nothing of eviction order, demotion or leases: that policy lives in the ``cache``
package, which never branches on which tier it is talking to.

Two kinds:

- ``Tier``: bytes in, bytes out (SSD files, Redis keys).
- ``SlotTier``: a tier whose bytes live in one mapped segment that clients on the same host
  address in place, by ``Slot`` (offset, length). The CPU shared-memory arena is one; a GPU
  HBM tier (CUDA IPC) will be another. ``allocate`` reserves room, the caller writes into
  ``view(slot)``, and the cache decides when the bytes count as stored.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from lmcache_svc.errors import TierError
from lmcache_svc.keys import ChunkKey

Buffer = bytes | bytearray | memoryview

Medium = Literal["host_memory", "device", "disk", "remote"]
"""Where a tier keeps its bytes: this host's memory, an accelerator's memory, a local disk,
or another machine reached over the network. What the engine reports a hit by, and whether a
call may wait on I/O (``Tier.may_block``)."""

MEDIA: tuple[Medium, ...] = ("host_memory", "device", "disk", "remote")
BLOCKING_MEDIA: frozenset[Medium] = frozenset({"disk", "remote"})
"""Media whose calls wait on I/O (a disk, the network)."""


@dataclass(frozen=True, slots=True)
class Failed:
    """One item of a batch that failed with ``error`` (``Corrupted``: the chunk was dropped).

    Falsy, like ``False``, so ``all(results)`` still means "every item done"; callers that
    must tell a failure from a normal miss or "no room" check ``isinstance(r, Failed)``.
    """

    error: TierError

    def __bool__(self) -> bool:
        return False


ItemResult = bool | Failed
"""One item of a batch: ``True`` done; ``False`` absent (read) or no room (put); ``Failed``."""


@dataclass(frozen=True, slots=True)
class ChunkDescription:
    """What a chunk holds, beyond its bytes: its token ids and its parent. Kept by the KV
    events (``server/events/meta.py``) and stored with the value by tiers that persist
    (``tiers/described.py``)."""

    parent: bytes
    """The previous chunk's hash, or the namespace id for a sequence's first chunk."""
    tokens: bytes
    """The chunk's token ids, little-endian uint32."""


@dataclass(frozen=True, slots=True)
class Slot:
    """A byte range of a ``SlotTier``'s segment holding (or reserved for) one chunk."""

    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """What a client needs to map a ``SlotTier``'s segment and check it is the right one.

    ``nonce`` is written at the start of the segment by the server: a client that maps a
    segment of the same name on another host reads different bytes and falls back to
    inline transfers.
    """

    transport: str
    name: str
    size: int
    nonce: bytes


@dataclass(frozen=True, slots=True)
class TierStats:
    name: str
    capacity_bytes: int
    used_bytes: int
    num_chunks: int


class Tier(ABC):
    """A storage medium for chunk bytes, addressed by ``ChunkKey``.

    Implementations are thread-safe: the cache calls them from many threads, and bulk I/O
    happens outside the cache's lock. Backend failures raise ``TierError`` (``Corrupted``
    for bytes that fail their checksum, after dropping them), except in the batch forms,
    which report them per item (``Failed``) so the caller knows what the tier holds.
    """

    name: str
    capacity_bytes: int
    medium: ClassVar[Medium]
    """Where this kind of tier keeps its bytes; every tier class sets it (``medium = "disk"``).
    The cache never branches on it: it tells a lookup's caller where each hit is, and the
    server whether a call may block (``may_block``)."""
    shared: bool = False
    """True when other servers may add or remove chunks (Redis): the cache asks the tier on
    a local miss instead of trusting its own index."""
    generation: int = 0
    """Changes when the medium behind the tier was replaced (a Redis that restarted between
    two calls, unnoticed by any failure): what the cache knew of its contents is stale."""
    on_refused: Callable[[int], None] | None = None
    """Told how many writes the backend itself refused for lack of memory (Redis ``-OOM``
    under ``maxmemory``): such a put answers "no room" (``False``), which is not a failure,
    so the cache (which sets this) counts them here, in ``tier_errors{kind="refused"}``."""
    describe: Callable[[ChunkKey], ChunkDescription | None] | None = None
    """Set by the cache when KV events are on: asked, for each chunk a tier that persists
    (SSD, Redis) writes, for the description to store with the value (``None``: the value
    is written as before, without one). Unset, nothing is asked."""

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    @abstractmethod
    def num_chunks(self) -> int: ...

    @abstractmethod
    def put(self, key: ChunkKey, data: Buffer) -> bool:
        """Store ``data`` under ``key`` (replacing any old value); ``False`` if it does not fit."""

    @abstractmethod
    def read_into(self, key: ChunkKey, out: memoryview) -> bool:
        """Copy the chunk into ``out`` (exactly its size); ``False`` if absent or dropped."""

    @abstractmethod
    def size_of(self, key: ChunkKey) -> int | None:
        """Stored size of the chunk, or ``None`` if absent."""

    @abstractmethod
    def delete(self, key: ChunkKey) -> int:
        """Remove the chunk; returns the bytes freed (0 if it was absent)."""

    @abstractmethod
    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Presence of each key, in order, in as few round trips as the medium allows."""

    def scan(self) -> Iterator[tuple[ChunkKey, int]]:
        """Chunks already stored when the server starts, least recently used first."""
        return iter(())

    def rescan(self) -> Iterator[tuple[ChunkKey, int]]:
        """``scan`` after the medium may have changed behind the tier's back (an outage, a
        restart): a tier with its own accounting rebuilds it from what it finds."""
        return self.scan()

    def describe_many(self, keys: Sequence[ChunkKey]) -> list[ChunkDescription | None]:
        """The description stored with each chunk's value (``None``: absent, stored without
        one, or damaged: logged), reading the values' headers only. Tiers that store none
        answer ``None`` for every key."""
        return [None] * len(keys)

    def get(self, key: ChunkKey) -> bytes | None:
        size = self.size_of(key)
        if size is None:
            return None
        out = bytearray(size)
        return bytes(out) if self.read_into(key, memoryview(out)) else None

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[ItemResult]:
        """Batch form of ``put``, one result per item in input order; media with round trips
        or spare I/O parallelism override it (Redis pipelines, SSD spreads writes over a few
        threads).

        Per item, never for the batch: ``True`` stored and counted; ``False`` does not fit;
        ``Failed`` the backend failed for that item, which is then not counted and not
        stored (an older value of the key may remain). A backend failure never raises here,
        so the caller always learns which items the tier holds; a caller's bug
        (``InvalidArgument``) still raises.
        """
        return [_attempt(self.put, key, data) for key, data in items]

    def read_many_into(self, items: Sequence[tuple[ChunkKey, memoryview]]) -> list[ItemResult]:
        """Batch form of ``read_into``, one result per item in input order; media with round
        trips or spare I/O parallelism override it (Redis pipelines, SSD threads).

        Per item, never for the batch: ``True`` read; ``False`` absent; ``Failed`` the
        backend failed for that item: with ``Corrupted`` the tier dropped the chunk, with
        any other ``TierError`` it still holds it. A wrong buffer size (``InvalidArgument``,
        a caller's bug) still raises.
        """
        return [_attempt(self.read_into, key, out) for key, out in items]

    def stats(self) -> TierStats:
        return TierStats(self.name, self.capacity_bytes, self.used_bytes, self.num_chunks)

    @property
    def may_block(self) -> bool:
        """Whether a call may wait on I/O (a disk, the network), so a server keeps it off
        its event loop."""
        return self.medium in BLOCKING_MEDIA

    def close(self) -> None:  # noqa: B027 - optional hook, most tiers have nothing to do
        """Release resources; the tier is not used afterwards."""


def _attempt(op: Callable[[ChunkKey, Any], bool], key: ChunkKey, buf: Any) -> ItemResult:
    try:
        return op(key, buf)
    except TierError as e:
        return Failed(e)


class SlotTier(Tier):
    """A tier whose chunks live in one segment that same-host clients map and address in place."""

    @abstractmethod
    def allocate(self, key: ChunkKey, nbytes: int) -> Slot | None:
        """Reserve a slot of ``nbytes`` for ``key``; ``None`` when there is no free room."""

    @abstractmethod
    def slot_of(self, key: ChunkKey) -> Slot | None: ...

    @abstractmethod
    def rename(self, old: ChunkKey, new: ChunkKey) -> None:
        """Give ``old``'s slot to ``new`` (which has none); ``old`` has none after."""

    @abstractmethod
    def view(self, slot: Slot) -> memoryview:
        """Writable view of exactly the slot's bytes in the server's own mapping."""

    @abstractmethod
    def segment(self) -> SegmentInfo: ...

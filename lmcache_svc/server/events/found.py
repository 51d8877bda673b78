"""Chunks a lower tier was found holding, described by what is stored with their values
(``tiers/described.py``), until they can be announced.

At start-up (an SSD tier's files after a restart, a shared Redis other servers wrote to) and
after a resync the cache hands the stream each chunk's description read back from the tier
(``ChunkListener.chunks_found``). A chunk whose namespace is not registered yet (always the
case at start-up), or whose tier is marked down, waits here; it is forgotten when its tier
drops it or a resync no longer finds it. At most what the cache read is kept:
``events.max_chunks`` chunks per tier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from lmcache_svc.keys import NAMESPACE_ID_BYTES, ChunkKey, chunk_hash_packed
from lmcache_svc.tiers.base import ChunkDescription, Tier

Found = tuple[ChunkKey, Tier, ChunkDescription]


class FoundChunks:
    """Per tier, found chunks not announced yet. Its owner (``NodeEvents``) calls it under
    its own lock."""

    def __init__(self) -> None:
        self._tiers: dict[str, tuple[Tier, dict[ChunkKey, ChunkDescription]]] = {}
        self._down: set[str] = set()

    def __bool__(self) -> bool:
        return any(chunks for _, chunks in self._tiers.values())

    def add(self, tier: Tier, found: Iterable[tuple[ChunkKey, ChunkDescription]]) -> None:
        self._tiers.setdefault(tier.name, (tier, {}))[1].update(found)

    def forget(self, tier: Tier, key: ChunkKey) -> None:
        """The tier no longer holds the chunk."""
        entry = self._tiers.get(tier.name)
        if entry is not None:
            entry[1].pop(key, None)

    def tier_down(self, tier: Tier) -> None:
        """Nothing in the tier is loadable until it is resynced: its chunks wait."""
        self._down.add(tier.name)

    def tier_holds(self, tier: Tier, held: set[ChunkKey]) -> None:
        """A resync found the tier holding exactly ``held``: it is up, its chunks not held
        are forgotten."""
        self._down.discard(tier.name)
        entry = self._tiers.get(tier.name)
        if entry is not None:
            for key in [k for k in entry[1] if k not in held]:
                del entry[1][key]

    def is_down(self, tier: Tier) -> bool:
        return tier.name in self._down

    def take(self, wanted: Callable[[ChunkKey], bool], tier: Tier | None = None) -> list[Found]:
        """Remove and return the chunks ``wanted`` accepts, of tiers not down (of ``tier``
        only, when given)."""
        out: list[Found] = []
        for name, (held_by, chunks) in self._tiers.items():
            if name in self._down or (tier is not None and name != tier.name):
                continue
            for key in [k for k in chunks if wanted(k)]:
                out.append((key, held_by, chunks.pop(key)))
        return out


def hashes_to(key: ChunkKey, desc: ChunkDescription) -> bool:
    """Whether a description is the chunk's: its parent and token ids hash to the key's
    chunk hash (``keys.chunk_hash``), a first chunk's parent being the key's namespace; the
    check ``meta.describe_chunks`` makes of a store's or a received description (whose
    token count the stream checks against the namespace's chunk size when it announces)."""
    first = len(desc.parent) == NAMESPACE_ID_BYTES
    if first and desc.parent != key[:NAMESPACE_ID_BYTES]:
        return False
    return chunk_hash_packed(desc.parent, desc.tokens) == key[NAMESPACE_ID_BYTES:]

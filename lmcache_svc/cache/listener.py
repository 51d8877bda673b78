"""``ChunkListener``: told where chunks become loadable and where they stop being so.

The cache calls a listener (``TieredCache(..., listener=...)``; the KV event stream,
``lmcache_svc/server/events/node_stream.py``) at the points where its indices change:

- ``chunk_changed(tier, key, True)`` when a chunk becomes loadable in a tier (a commit or
  a promotion into the first tier; a write-through, demotion or read that indexes it in a
  lower tier), ``False`` when it stops being loadable there (eviction, delete, a failed
  checksum, a read that found it gone). Calls may repeat; the listener deduplicates.
- ``tier_contents(tier, keys)`` after a lower tier's index was rebuilt (a resync: the tier
  now holds exactly ``keys``), or ``tier_contents(tier, None)`` when the tier is marked down
  (nothing in it is loadable until it comes back and is resynced).
- ``chunk_described(key, meta)`` with a chunk's token ids and parent, before the commit
  that makes it loadable (``meta`` is ``events.meta.ChunkMeta``).
- ``namespace_registered(namespace)``.
- ``description(key)``: the chunk's description, if known, for a lower tier that stores it
  with the value (set as each such tier's ``Tier.describe``).
- ``chunks_found(tier, found)`` with the descriptions a lower tier holds for chunks it
  already held at start-up (``Tier.scan``) or that a resync found, read from the values'
  headers (``Tier.describe_many``) for at most ``max_described`` chunks, the most recently
  used first; called before the resync's ``tier_contents``, never under the cache's locks.

Calls come from the cache's threads, some under the cache's or the lower tiers' lock: a
listener must be quick, never block and never call back into the cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from lmcache_svc.keys import ChunkKey, Namespace
from lmcache_svc.tiers.base import ChunkDescription, Tier

if TYPE_CHECKING:
    from lmcache_svc.server.events.meta import ChunkMeta


class ChunkListener(Protocol):
    def namespace_registered(self, namespace: Namespace) -> None: ...

    def chunk_described(self, key: ChunkKey, meta: ChunkMeta) -> None: ...

    def chunk_changed(self, tier: Tier, key: ChunkKey, loadable: bool) -> None: ...

    def tier_contents(self, tier: Tier, keys: Iterable[ChunkKey] | None) -> None: ...

    @property
    def max_described(self) -> int: ...

    def description(self, key: ChunkKey) -> ChunkDescription | None: ...

    def chunks_found(
        self, tier: Tier, found: Sequence[tuple[ChunkKey, ChunkDescription]]
    ) -> None: ...

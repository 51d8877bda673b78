"""The tiered cache's lookup path: where the longest stored prefix of a request is."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from lmcache_svc.cache.core import CacheCore
from lmcache_svc.cache.values import LookupResult
from lmcache_svc.keys import ChunkKey


class LookupPath:
    def __init__(self, core: CacheCore) -> None:
        self._core = core
        self._media = {t.name: t.medium for t in core.tiers}

    def lookup(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> LookupResult:
        """Longest contiguous prefix of the chunks present in any tier, and where each is."""
        keys = self._core.namespaces.keys(namespace_id, chunk_hashes)
        tiers = self._locate_local(keys)
        rest = keys[len(tiers) :]
        if rest:
            tiers += [lt.tier.name for lt in self._core.lower.sources(rest)]
        return self._counted_lookup(keys, tiers)

    def lookup_local(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes]
    ) -> LookupResult | None:
        """``lookup``'s answer when the in-memory indices give all of it, else ``None`` (a
        shared tier that is not marked down would have to be asked). Never blocks on a
        lower tier."""
        keys = self._core.namespaces.keys(namespace_id, chunk_hashes)
        tiers = self._locate_local(keys)
        if len(tiers) < len(keys) and self._core.lower.shared_in_use:
            return None
        return self._counted_lookup(keys, tiers)

    def first_tier_holds(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> bool:
        """Whether every chunk is readable in the first tier now (a load needs no lower tier)."""
        core = self._core
        keys = core.namespaces.keys(namespace_id, chunk_hashes)
        with core.lock:
            return all(core.slots.readable(key) for key in keys)

    def contains(self, namespace_id: bytes, chunk_hash: bytes) -> str | None:
        """Name of the tier holding the chunk, or None."""
        result = self.lookup(namespace_id, [chunk_hash])
        return result.tiers[0] if result.num_hit_chunks else None

    def _counted_lookup(self, keys: list[ChunkKey], tiers: list[str]) -> LookupResult:
        metrics = self._core.metrics
        metrics.lookup_chunks.inc(len(keys))
        metrics.lookup_hit_chunks.inc(len(tiers))
        metrics.misses.inc(len(keys) - len(tiers))
        for name, num in Counter(tiers).items():
            metrics.hits.labels(tier=name).inc(num)
        return LookupResult(len(tiers), tiers, [self._media[name] for name in tiers])

    def _locate_local(self, keys: list[ChunkKey]) -> list[str]:
        """Where each chunk of the longest prefix known to the in-memory indices is."""
        core = self._core
        slots, lower, first_name = core.slots, core.lower, core.first.name
        found: list[str] = []
        with core.lock:
            for key in keys:
                if slots.readable(key):
                    found.append(first_name)
                    continue
                tier = lower.local_tier(key)
                if tier is None:
                    break
                found.append(tier.name)
        return found

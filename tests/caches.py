"""``CacheFactory``: the tiered caches the cache tests build, and their clean-up.

Each cache is an arena of ``num_chunks`` chunks, optionally with an SSD tier below it, with
the test's namespaces registered. A test file wraps one factory in a fixture:

    @pytest.fixture
    def make_cache(tmp_path: Path) -> Iterator[CacheFactory]:
        with CacheFactory(CHUNK, [NS], tmp_path) as factory:
            yield factory
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.cache.values import TierPolicy
from lmcache_svc.keys import Namespace
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.base import Tier
from lmcache_svc.tiers.cpu import CpuTier
from lmcache_svc.tiers.ssd import SsdTier

SSD_SLACK = 4096  # an SSD tier's bytes per chunk over the payload (its file header)


class CacheFactory:
    """Builds caches of ``chunk_bytes`` chunks; closes every one it built on ``close``.

    ``start``: start each cache's background threads. ``defaults``: ``CacheSettings`` fields
    every cache gets unless a call sets them."""

    def __init__(
        self,
        chunk_bytes: int,
        namespaces: Sequence[Namespace],
        tmp_path: Path | None = None,
        *,
        start: bool = False,
        **defaults: object,
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self._namespaces = list(namespaces)
        self._tmp_path = tmp_path
        self._start = start
        self._defaults = defaults
        self.made: list[TieredCache] = []

    def __call__(
        self,
        num_chunks: int = 4,
        *,
        ssd_chunks: int | None = None,
        write_through: bool = False,
        settings: CacheSettings | None = None,
        **fields: object,
    ) -> TieredCache:
        """A cache whose arena holds ``num_chunks``; ``ssd_chunks``: an SSD tier of that
        many below it; ``settings`` or ``fields`` (over the defaults): its settings."""
        if settings is not None and fields:
            raise TypeError(f"give settings or settings fields, not both: {sorted(fields)}")
        if settings is None:
            settings = CacheSettings(**{**self._defaults, **fields})  # type: ignore[arg-type]
        size = self.chunk_bytes
        arena = Arena.create(num_chunks * size, slab_bytes=size, prefault="off")
        lower: list[tuple[Tier, TierPolicy]] = []
        if ssd_chunks is not None:
            if self._tmp_path is None:
                raise TypeError("an SSD tier needs the factory's tmp_path")
            ssd = SsdTier(self._tmp_path / f"ssd{len(self.made)}", ssd_chunks * (size + SSD_SLACK))
            lower.append((ssd, TierPolicy(accept_demotions=True, write_through=write_through)))
        cache = TieredCache(CpuTier(arena), lower, settings=settings)
        self.made.append(cache)
        for ns in self._namespaces:
            cache.register_namespace(ns)
        if self._start:
            cache.start()
        return cache

    def close(self) -> None:
        for cache in self.made:
            cache.close()

    def __enter__(self) -> CacheFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

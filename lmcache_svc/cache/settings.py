"""The cache's settings: the validated ``cache`` section of the configuration.

``config.CacheConfig`` is the one place that declares each setting, its default and its
limits (documented in docs/configuration.md); ``CacheSettings`` adds only what the cache
takes from elsewhere in the configuration, so a cache built in a test or a benchmark gets
the same defaults and the same validation as the server's.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field

from lmcache_svc.config import CacheConfig, Config
from lmcache_svc.keys import MAX_CHUNK_BYTES


class CacheSettings(CacheConfig):
    model_config = ConfigDict(frozen=True)

    max_chunk_bytes: int = Field(MAX_CHUNK_BYTES, gt=0)
    """Largest chunk a namespace may have (the server passes its ``max_body_bytes``)."""

    @classmethod
    def from_config(cls, config: Config) -> CacheSettings:
        """The settings of the server that ``config`` describes."""
        return cls(**config.cache.model_dump(), max_chunk_bytes=int(config.max_body_bytes))

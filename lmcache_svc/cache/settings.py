"""The cache's settings: the validated ``cache`` section of the configuration.

``config.CacheConfig`` is the one place that declares each setting, its default and its
limits (documented in docs/configuration.md); ``CacheSettings`` adds only what the cache
takes from elsewhere in the configuration (``max_body_bytes``, the ``tuning`` section's
checksum pacing), so a cache built in a test or a benchmark gets
the same defaults and the same validation as the server's.
"""

from __future__ import annotations

from copy import copy
from typing import Any

from pydantic import ConfigDict, Field

from lmcache_svc.config import CacheConfig, Config, TuningConfig
from lmcache_svc.keys import MAX_CHUNK_BYTES


def _tuning_field(name: str) -> Any:
    """A copy of the ``tuning`` section's declaration of ``name`` (default and limits)."""
    return copy(TuningConfig.model_fields[name])


class CacheSettings(CacheConfig):
    model_config = ConfigDict(frozen=True)

    max_chunk_bytes: int = Field(MAX_CHUNK_BYTES, gt=0)
    """Largest chunk a namespace may have (the server passes its ``max_body_bytes``)."""
    # tuning.checksum_*: the same declarations (default, limits) as the server's section
    checksum_quiet_s: float = _tuning_field("checksum_quiet_s")
    checksum_max_delay_s: float = _tuning_field("checksum_max_delay_s")

    @classmethod
    def from_config(cls, config: Config) -> CacheSettings:
        """The settings of the server that ``config`` describes."""
        t = config.tuning
        return cls(
            **config.cache.model_dump(),
            max_chunk_bytes=int(config.max_body_bytes),
            checksum_quiet_s=t.checksum_quiet_s,
            checksum_max_delay_s=t.checksum_max_delay_s,
        )

"""Plain values that configure and describe the tiered cache: how it uses a lower tier, and
the results of its calls (no behaviour here beyond deriving a ``TierPolicy`` from its tier's
configuration section; the cache's settings are ``settings.CacheSettings``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lmcache_svc.config import HbmConfig, RedisConfig, SsdConfig
from lmcache_svc.keys import ChunkHash
from lmcache_svc.results import LookupResult as LookupResult  # the cache's lookup answer
from lmcache_svc.results import StoreStatus
from lmcache_svc.tiers.base import Slot, TierStats


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """How the cache uses a lower tier (any tier after the first)."""

    accept_demotions: bool = True
    """Chunks evicted from the tiers above are moved here instead of being dropped."""
    write_through: bool = False
    """Every committed chunk is also copied here, in the background (off the hot path)."""
    backoff_s: float = 0.5
    """After a failure or timeout the tier is skipped this long before a probe call; each
    failed probe doubles it (circuit breaker, ``breaker.py``)."""
    max_backoff_s: float = 30.0
    """Cap of the doubled backoff."""
    slow_call_s: float = 1.0
    """A lookup-sized call (presence, size, delete) in flight this long marks the tier down
    for every other caller (a hung backend raises nothing until its socket timeout)."""

    @classmethod
    def from_config(cls, section: HbmConfig | SsdConfig | RedisConfig) -> TierPolicy:
        """The policy of the lower tier that ``section`` configures: its ``accept_demotions``
        and ``write_through`` (HBM has none: never), and Redis's circuit-breaker limits (the
        other tiers keep the defaults)."""
        if isinstance(section, RedisConfig):
            return cls(
                section.accept_demotions,
                section.write_through,
                backoff_s=section.breaker_backoff_s,
                max_backoff_s=section.breaker_max_backoff_s,
                slow_call_s=section.slow_call_s(),
            )
        write_through = section.write_through if isinstance(section, SsdConfig) else False
        return cls(section.accept_demotions, write_through)


@dataclass(frozen=True, slots=True)
class PreparedStore:
    chunk_hash: ChunkHash
    status: StoreStatus
    slot: Slot | None = None


@dataclass(frozen=True, slots=True)
class LeasedSlots:
    """Chunks pinned in the first tier for reading; ``lease_id`` is None when none were."""

    lease_id: str | None
    slots: list[Slot] = field(default_factory=list)
    source_tiers: list[str] = field(default_factory=list)
    """Where each chunk was found before any promotion."""


@dataclass(frozen=True, slots=True)
class CacheStats:
    tiers: list[TierStats]
    active_leases: int
    pending_stores: int
    num_namespaces: int

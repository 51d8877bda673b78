"""Plain values that configure and describe the tiered cache (no behaviour here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lmcache_svc.keys import MAX_CHUNK_BYTES, ChunkHash
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


@dataclass(frozen=True, slots=True)
class CacheSettings:
    high_watermark: float = 0.95
    """Background eviction starts when the first tier's used bytes pass this fraction."""
    low_watermark: float = 0.85
    """... and stops when they are back under this fraction."""
    lease_ttl_s: float = 30.0
    max_lease_ttl_s: float = 600.0
    reservation_ttl_s: float = 30.0
    max_reservation_ttl_s: float = 120.0
    """Longest store reservation a client may ask for (its slots are unusable meanwhile)."""
    max_reserved_fraction: float = 0.5
    """Most of the first tier's capacity one owner (a session, an inline upload, or all
    session-less callers together) may hold reserved, expired reservations not yet let go
    of (quarantined) included."""
    max_chunks_per_request: int = 8192
    max_namespaces: int = 4096
    """Most namespaces registered at once; registering one more is ``TooManyNamespaces``."""
    max_chunk_bytes: int = MAX_CHUNK_BYTES
    """Largest chunk a namespace may have (the server passes its ``max_body_bytes``)."""
    checksums: bool = True
    """Keep an xxh3-64 of each first-tier chunk (taken in the background after commit or
    promotion), checked on demotion, write-through and loads that ask ``verify``."""
    maintenance_interval_s: float = 0.05


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

"""The answers that both the cache and the client give (plain values, no dependencies):
what a lookup found and what ``prepare_store`` did with each chunk."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from lmcache_svc.tiers.base import Medium

StoreStatus = Literal["reserved", "already_stored", "no_space", "in_progress"]


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest contiguous prefix present in any tier, and which tier holds each chunk."""

    num_hit_chunks: int
    tiers: list[str]
    media: list[Medium] = field(default_factory=list)
    """The medium of the tier holding each hit chunk (``Tier.medium``)."""

"""The answers that both the cache and the client give (plain values, no dependencies):
what a lookup found and what ``prepare_store`` did with each chunk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StoreStatus = Literal["reserved", "already_stored", "no_space", "in_progress"]


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest contiguous prefix present in any tier, and which tier holds each chunk."""

    num_hit_chunks: int
    tiers: list[str]

"""The answers that both the cache and the client give (plain values, no dependencies):
what a lookup found and what ``prepare_store`` did with each chunk."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from lmcache_svc.tiers.base import Medium

StoreStatus = Literal["reserved", "already_stored", "no_space", "in_progress"]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where chunks' bytes were in a server's arena when its shared lookup index was read:
    the index table's nonce, its sequence counter then, and each chunk's location word.
    Plain values, so a lookup's answer can travel to the process that loads the chunks and
    save it reading the index again (``client.in_place.read_in_place``)."""

    nonce: bytes
    seq: int
    locations: tuple[int, ...]

    def part(self, start: int, stop: int) -> Placement:
        return Placement(self.nonce, self.seq, self.locations[start:stop])


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest contiguous prefix present in any tier, and which tier holds each chunk."""

    num_hit_chunks: int
    tiers: list[str]
    media: list[Medium] = field(default_factory=list)
    """The medium of the tier holding each hit chunk (``Tier.medium``)."""
    placement: Placement | None = field(default=None, compare=False)
    """Answered from the shared lookup index: where the hit chunks were in the arena."""

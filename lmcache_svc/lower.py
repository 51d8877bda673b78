"""The tiers below the first: which chunks each holds, and how chunks move among them.

Each lower tier has an index (chunk key -> size, least recently used first) of what it is
known to hold: rebuilt from ``Tier.scan()`` at start-up and kept up to date by every put,
read and delete made through here. A ``shared`` tier (Redis) may also hold chunks other
servers wrote, so a local miss there is confirmed with one batched ``contains_many``.

Moves: a chunk evicted from above is *demoted* to the first tier that accepts demotions and
does not hold it yet; a full tier evicts its own LRU chunk further down first. Reads for
promotion are batched per tier. Backend failures are logged and counted, and behave as a
miss: a broken lower tier never fails a request.

The indices follow each batch item by item (``Tier.put_many``/``read_many_into`` report
every item): a chunk the tier stored is indexed, one it refused is not, one it could not
read stays indexed unless the tier dropped it (absent, or ``Corrupted``), and one it failed
to delete goes back into the index. So every chunk a tier counts stays evictable.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from lmcache_svc.errors import Corrupted, TierError
from lmcache_svc.keys import ChunkKey
from lmcache_svc.metrics import Metrics
from lmcache_svc.policy import TierPolicy
from lmcache_svc.tiers.base import Buffer, Failed, ItemResult, Tier

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LowerTier:
    tier: Tier
    policy: TierPolicy
    index: OrderedDict[ChunkKey, int]


class LowerTiers:
    def __init__(self, tiers: Sequence[tuple[Tier, TierPolicy]], metrics: Metrics) -> None:
        self._tiers = [LowerTier(t, p, OrderedDict(t.scan())) for t, p in tiers]
        self._metrics = metrics
        self._lock = threading.Lock()

    @property
    def tiers(self) -> list[Tier]:
        return [lt.tier for lt in self._tiers]

    @property
    def has_write_through(self) -> bool:
        return any(lt.policy.write_through for lt in self._tiers)

    # -- where chunks are ------------------------------------------------------------------

    def local_tier(self, key: ChunkKey) -> Tier | None:
        """The first lower tier whose index holds the chunk."""
        with self._lock:
            return next((lt.tier for lt in self._tiers if key in lt.index), None)

    def sources(self, keys: Sequence[ChunkKey]) -> list[LowerTier]:
        """The tier to read each chunk of the longest prefix of ``keys`` found below."""
        plan: list[LowerTier] = []
        with self._lock:
            for key in keys:
                lt = next((lt for lt in self._tiers if key in lt.index), None)
                if lt is None:
                    break
                plan.append(lt)
        rest = keys[len(plan) :]
        for lt in self._tiers:
            if not rest:
                break
            if not lt.tier.shared:
                continue
            try:
                present = lt.tier.contains_many(rest)
            except TierError as e:
                self._failed(lt.tier, e)
                continue
            num = next((i for i, p in enumerate(present) if not p), len(present))
            plan += [lt] * num
            rest = rest[num:]
        return plan

    # -- reads -----------------------------------------------------------------------------

    def read_up(self, items: Sequence[tuple[ChunkKey, LowerTier, memoryview]]) -> list[bool]:
        """Read each chunk from its tier into its buffer, batched per tier; success per item."""
        ok = [False] * len(items)
        for lt in self._tiers:
            mine = [(i, key, out) for i, (key, src, out) in enumerate(items) if src is lt]
            if not mine:
                continue
            results = lt.tier.read_many_into([(key, out) for _, key, out in mine])
            self._report(lt.tier, results)
            with self._lock:
                for (i, key, out), result in zip(mine, results):
                    ok[i] = result is True
                    if result is True:
                        self._metrics.bytes_read.labels(tier=lt.tier.name).inc(len(out))
                        if key in lt.index:
                            lt.index.move_to_end(key)
                        elif not lt.tier.shared:
                            lt.index[key] = len(out)
                    elif _gone(result):
                        lt.index.pop(key, None)
        return ok

    # -- writes ----------------------------------------------------------------------------

    def demote(self, key: ChunkKey, data: memoryview, below: int = 0) -> None:
        """Give an evicted chunk to the first tier after position ``below`` that takes it."""
        for position in range(below, len(self._tiers)):
            lt = self._tiers[position]
            with self._lock:
                if key in lt.index:
                    return  # already there (written through, or promoted from there)
            if lt.policy.accept_demotions and self._put(position, key, data):
                self._metrics.demotions.labels(tier=lt.tier.name).inc()
                return

    def copy_through(self, items: Sequence[tuple[ChunkKey, memoryview]]) -> None:
        """Copy committed chunks to every write-through tier that does not hold them."""
        for position, lt in enumerate(self._tiers):
            if not lt.policy.write_through:
                continue
            with self._lock:
                todo = [(k, v) for k, v in items if k not in lt.index]
            results = lt.tier.put_many(todo)
            self._report(lt.tier, results)
            for (key, view), result in zip(todo, results):
                if result is True:
                    self._stored(lt, key, len(view))
                elif not isinstance(result, Failed):  # no room: evict, then try again
                    self._put(position, key, view)

    def _put(self, position: int, key: ChunkKey, data: Buffer) -> bool:
        """Put into the tier at ``position``, evicting its LRU chunks while it is full."""
        lt = self._tiers[position]
        while True:
            try:
                if lt.tier.put(key, data):
                    self._stored(lt, key, len(data))
                    return True
            except TierError as e:
                self._failed(lt.tier, e)
                return False
            if not self._evict_one(position):
                return False

    def _stored(self, lt: LowerTier, key: ChunkKey, size: int) -> None:
        with self._lock:
            lt.index[key] = size
        self._metrics.bytes_written.labels(tier=lt.tier.name).inc(size)

    def _evict_one(self, position: int) -> bool:
        """Evict the tier's least recently used chunk, demoting it further down."""
        lt = self._tiers[position]
        with self._lock:
            if not lt.index:
                return False
            key, size = lt.index.popitem(last=False)
        try:
            if any(x.policy.accept_demotions for x in self._tiers[position + 1 :]):
                data = bytearray(size)
                if lt.tier.read_into(key, memoryview(data)):
                    self.demote(key, memoryview(data), below=position + 1)
        except TierError as e:
            self._failed(lt.tier, e)  # not demoted: it is dropped below
        try:
            lt.tier.delete(key)
        except TierError as e:
            self._failed(lt.tier, e)
            self._restore(lt, key, size)  # still held and counted there: evict it later
            return False
        self._metrics.evictions.labels(tier=lt.tier.name).inc()
        return True

    def _restore(self, lt: LowerTier, key: ChunkKey, size: int) -> None:
        """Put back the index entry of a chunk the tier failed to delete, least recent."""
        with self._lock:
            if key not in lt.index:
                lt.index[key] = size
                lt.index.move_to_end(key, last=False)

    def delete(self, key: ChunkKey) -> bool:
        """Remove the chunk from every lower tier; True if one of them held it."""
        found = False
        for lt in self._tiers:
            with self._lock:
                size = lt.index.pop(key, None)
            if size is None and not lt.tier.shared:
                continue
            try:
                found = lt.tier.delete(key) > 0 or found
            except TierError as e:
                self._failed(lt.tier, e)
                if size is not None:
                    self._restore(lt, key, size)
        return found

    def _report(self, tier: Tier, results: Sequence[ItemResult]) -> None:
        """Log and count each distinct error of a batch (one for a batch that failed whole)."""
        errors = {id(r.error): r.error for r in results if isinstance(r, Failed)}
        for error in errors.values():
            self._failed(tier, error)

    def _failed(self, tier: Tier, error: TierError) -> None:
        log.warning("tier %s failed: %s", tier.name, error)
        self._metrics.errors.labels(kind=error.kind).inc()
        self._metrics.tier_errors.labels(tier=tier.name, kind=error.kind).inc()

    def close(self) -> None:
        for lt in self._tiers:
            lt.tier.close()


def _gone(result: ItemResult) -> bool:
    """Whether a read's result means the tier no longer holds the chunk: absent, or dropped
    as corrupted. After any other failure the tier still holds (and counts) it, so the index
    keeps it, to be read again or evicted later."""
    return result is False or (isinstance(result, Failed) and isinstance(result.error, Corrupted))

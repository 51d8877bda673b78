"""The cache's management of the tiers below the first: which chunks each holds, and how
chunks move among them.

Each lower tier has a tier index, ``LowerTierState.contents`` (chunk key -> size, least
recently used first), of what it is known to hold: rebuilt from ``Tier.scan()`` at
start-up and kept up to date by every put, read and delete made through here. A
``shared`` tier (Redis) may also hold chunks other servers wrote, so a local miss there is
confirmed with one batched ``contains_many``.

Moves: a chunk evicted from above is *demoted* to the first tier that accepts demotions and
does not hold it yet; a full tier evicts its own LRU chunk further down first. Reads for
promotion are batched per tier. Backend failures are logged and counted, and behave as a
miss: a broken lower tier never fails a request.

The indices follow each batch item by item (``Tier.put_many``/``read_many_into`` report
every item): a chunk the tier stored is indexed, one it refused is not, one it could not
read stays indexed unless the tier dropped it (absent, or ``Corrupted``), and one it failed
to delete goes back into the index. So every chunk a tier counts stays evictable.

Faults: every call to a tier goes through its ``CircuitBreaker``. After a failure or a
timeout (or a lookup-sized call hung past ``TierPolicy.slow_call_s``) the tier is skipped:
lookups and loads treat it as a miss, demotion moves on to the next tier, write-through and
deletes leave it alone. After the backoff one call probes it, always on a thread of its own
(started by the maintenance thread, so a tier comes back without traffic, or by a caller
that found the tier skipped, which does not wait for it); when a tier comes back from
an outage, or when its ``generation`` changed (a Redis restarted between two calls), its
index and accounting are rebuilt in the background from what the tier holds
(``Tier.rescan``), so a Redis that restarted empty (or with an older snapshot) is not
believed to hold what it lost.

Descriptions (KV events on, ``listener.py``): each lower tier is given the listener's
``description`` to store with the values it writes, and the descriptions of chunks a tier
held at start-up (a restarted SSD tier, a Redis other servers wrote to) or that a resync
found new are read back from the values' headers (``Tier.describe_many``), at most the
listener's ``max_described`` per tier, most recently used first, and handed to the
listener, so those chunks are announced.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lmcache_svc.cache.breaker import STATE_CODES, CircuitBreaker
from lmcache_svc.cache.listener import ChunkListener
from lmcache_svc.cache.values import TierPolicy
from lmcache_svc.errors import Corrupted, TierError
from lmcache_svc.keys import CHUNK_KEY_BYTES, ChunkKey
from lmcache_svc.metrics import Metrics
from lmcache_svc.tiers.base import Buffer, Failed, ItemResult, Tier

log = logging.getLogger(__name__)
T = TypeVar("T")
D = TypeVar("D")

_QUICK_OPS = frozenset({"contains", "size_of", "delete", "probe"})
_RECENT_DELETES = 4096
"""Deletes remembered by number, to tell whether one came while a put or read of the same
chunk was in flight (older ones count as "maybe": the put or read is then undone)."""


class _DeleteLog:
    """Numbers the deletes (or, in a second log, the evictions), and remembers the last
    ``_RECENT_DELETES`` of them by key.

    A put or read runs outside the lock; a delete of its chunk may come meanwhile, find
    nothing in the index yet, and leave the tier alone. The put or read notes the count
    before it starts (``count``) and, once done, asks ``deleted_since``: if so, it must not
    index the chunk (and a put deletes what it wrote). A read also asks the evictions' log:
    a chunk read while it was being evicted is deleted by that eviction. Used under the
    manager's lock."""

    __slots__ = ("count", "_recent", "_forgotten_upto")

    def __init__(self) -> None:
        self.count = 0
        self._recent: OrderedDict[ChunkKey, int] = OrderedDict()
        self._forgotten_upto = 0

    def record(self, key: ChunkKey) -> None:
        self.count += 1
        self._recent[key] = self.count
        self._recent.move_to_end(key)
        if len(self._recent) > _RECENT_DELETES:
            _, self._forgotten_upto = self._recent.popitem(last=False)

    def deleted_since(self, key: ChunkKey, since: int) -> bool:
        number = self._recent.get(key)
        if number is not None:
            return number > since
        return self._forgotten_upto > since  # a forgotten delete may have been of this key


"""Calls that take one round trip on a healthy tier: the only ones the slow-call check
watches (a large batch may legitimately take longer)."""
_PROBE_KEY = ChunkKey(b"\0" * CHUNK_KEY_BYTES)
"""Asked for by probes: present or not, an answer means the tier is reachable."""


@dataclass(slots=True)
class LowerTierState:
    tier: Tier
    policy: TierPolicy
    contents: OrderedDict[ChunkKey, int]
    breaker: CircuitBreaker
    generation: int = 0
    busy: set[ChunkKey] = field(default_factory=set)
    """Chunks with a put or an eviction in flight in this tier (``LowerTierManager._claim``)."""


class LowerTierManager:
    def __init__(
        self,
        tiers: Sequence[tuple[Tier, TierPolicy]],
        metrics: Metrics,
        listener: ChunkListener | None = None,
    ) -> None:
        self._metrics = metrics
        self._listener = listener
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # a chunk's put or eviction ended
        self._tiers = [self._make(t, p) for t, p in tiers]
        self._resyncing: set[str] = set()
        self._probing: set[str] = set()
        self._closing = False
        self._deletes = _DeleteLog()
        self._evictions = _DeleteLog()
        for lt in self._tiers:
            self._describe_found(lt, list(lt.contents))

    def _make(self, tier: Tier, policy: TierPolicy) -> LowerTierState:
        trips = self._metrics.breaker_trips.labels(tier=tier.name)
        listener = self._listener

        def tripped() -> None:
            trips.inc()
            if listener is not None:  # nothing in it is loadable until it is resynced
                listener.tier_contents(tier, None)

        breaker = CircuitBreaker(
            base_backoff_s=policy.backoff_s,
            max_backoff_s=policy.max_backoff_s,
            slow_call_s=policy.slow_call_s,
            on_trip=tripped,
        )
        self._metrics.breaker_state.labels(tier=tier.name).set_function(
            lambda: STATE_CODES[breaker.state]
        )
        refused = self._metrics.tier_errors.labels(tier=tier.name, kind="refused")
        tier.on_refused = refused.inc  # writes the backend refused for memory (Redis -OOM)
        if listener is not None:
            tier.describe = listener.description
        return LowerTierState(tier, policy, OrderedDict(tier.scan()), breaker, tier.generation)

    @property
    def tiers(self) -> list[Tier]:
        return [lt.tier for lt in self._tiers]

    @property
    def shared_in_use(self) -> bool:
        """Whether a shared tier might be asked now (one is configured and not marked down)."""
        return any(lt.tier.shared and lt.breaker.may_allow() for lt in self._tiers)

    @property
    def has_write_through(self) -> bool:
        return any(lt.policy.write_through for lt in self._tiers)

    # -- where chunks are ------------------------------------------------------------------

    def local_tier(self, key: ChunkKey) -> Tier | None:
        """The first lower tier in use (not marked down) whose index holds the chunk."""
        with self._lock:
            return next((lt.tier for lt in self._tiers if key in lt.contents and _up(lt)), None)

    def sources(self, keys: Sequence[ChunkKey]) -> list[LowerTierState]:
        """The tier to read each chunk of the longest prefix of ``keys`` found below."""
        plan: list[LowerTierState] = []
        with self._lock:
            for key in keys:
                lt = next((lt for lt in self._tiers if key in lt.contents and _up(lt)), None)
                if lt is None:
                    break
                plan.append(lt)
        rest = keys[len(plan) :]
        for lt in self._tiers:
            if not rest:
                break
            if not lt.tier.shared:
                continue
            present = self._call(lt, "contains", None, lt.tier.contains_many, rest)
            if present is None:
                continue
            num = next((i for i, p in enumerate(present) if not p), len(present))
            plan += [lt] * num
            rest = rest[num:]
        return plan

    # -- reads -----------------------------------------------------------------------------

    def read_up(self, items: Sequence[tuple[ChunkKey, LowerTierState, memoryview]]) -> list[bool]:
        """Read each chunk from its tier into its buffer, batched per tier; success per item."""
        ok = [False] * len(items)
        with self._lock:
            since, evictions_since = self._deletes.count, self._evictions.count
        for lt in self._tiers:
            mine = [(i, key, out) for i, (key, src, out) in enumerate(items) if src is lt]
            if not mine:
                continue
            batch = [(key, out) for _, key, out in mine]
            results = self._call(lt, "read", None, lt.tier.read_many_into, batch)
            if results is None:
                continue  # marked down: misses, and the index keeps what the tier holds
            self._report(lt.tier, results)
            with self._lock:
                for (i, key, out), result in zip(mine, results):
                    ok[i] = result is True
                    if result is True:
                        self._metrics.bytes_read.labels(tier=lt.tier.name).inc(len(out))
                        if key in lt.contents:
                            lt.contents.move_to_end(key)
                        elif not lt.tier.shared and not (
                            self._deletes.deleted_since(key, since)
                            or self._evictions.deleted_since(key, evictions_since)
                        ):
                            lt.contents[key] = len(out)
                            self._changed(lt, key, True)
                    elif _gone(result):
                        lt.contents.pop(key, None)
                        self._changed(lt, key, False)
        return ok

    # -- writes ----------------------------------------------------------------------------

    def delete_count(self) -> int:
        """Deletes so far: a demotion notes it when its chunk leaves the first tier's index
        (``demote(..., since=)``), so a delete that comes before the write is seen."""
        with self._lock:
            return self._deletes.count

    def demote(
        self, key: ChunkKey, data: memoryview, below: int = 0, since: int | None = None
    ) -> None:
        """Give an evicted chunk to the first tier after position ``below`` that takes it."""
        for position in range(below, len(self._tiers)):
            lt = self._tiers[position]
            with self._lock:
                if key in lt.contents:
                    return  # already there (written through, or promoted from there)
            if lt.policy.accept_demotions and self._put(position, key, data, since):
                self._metrics.demotions.labels(tier=lt.tier.name).inc()
                return

    def copy_through(self, items: Sequence[tuple[ChunkKey, memoryview]]) -> None:
        """Copy committed chunks to every write-through tier that does not hold them."""
        with self._lock:
            since = self._deletes.count
        for position, lt in enumerate(self._tiers):
            if not lt.policy.write_through:
                continue
            with self._lock:
                todo = [(k, v) for k, v in items if k not in lt.contents]
            if not todo:
                continue
            with self._claim(lt, [k for k, _ in todo]):
                results = self._call(lt, "write_through", None, lt.tier.put_many, todo)
                if results is None:
                    continue
                self._report(lt.tier, results)
                for (key, view), result in zip(todo, results):
                    if result is True:
                        self._stored(lt, key, len(view), since)
                    elif not isinstance(result, Failed):  # no room: evict, then try again
                        self._put_claimed(position, key, view, since)

    def _put(self, position: int, key: ChunkKey, data: Buffer, since: int | None = None) -> bool:
        """Put into the tier at ``position``, evicting its LRU chunks while it is full;
        ``since``: the delete count when the chunk's move began (default: now)."""
        if since is None:
            since = self.delete_count()
        with self._claim(self._tiers[position], [key]):
            return self._put_claimed(position, key, data, since)

    def _put_claimed(self, position: int, key: ChunkKey, data: Buffer, since: int) -> bool:
        lt = self._tiers[position]
        while True:
            stored = self._call(lt, "put", None, lt.tier.put, key, data)
            if stored is None:
                return False  # down or failing: the caller moves on to the next tier
            if stored:
                self._stored(lt, key, len(data), since)
                return True
            if not self._evict_one(position):
                return False

    def _stored(self, lt: LowerTierState, key: ChunkKey, size: int, since: int) -> None:
        """Index a chunk the tier took, unless it was deleted while the write was in flight
        (``since``: the delete count before it began): then the write is undone."""
        with self._lock:
            deleted = self._deletes.deleted_since(key, since)
            if not deleted:
                lt.contents[key] = size
                self._changed(lt, key, True)
        self._metrics.bytes_written.labels(tier=lt.tier.name).inc(size)
        if deleted:
            self._call(lt, "delete", None, lt.tier.delete, key)

    def _evict_one(self, position: int) -> bool:
        """Evict the tier's least recently used chunk, demoting it further down."""
        lt = self._tiers[position]
        with self._lock:
            key = next((k for k in lt.contents if k not in lt.busy), None)
            if key is None:
                return False
            size = lt.contents.pop(key)
            lt.busy.add(key)  # released below, after the delete: see ``_claim``
            self._evictions.record(key)  # a read of it meanwhile must not index it again
            self._changed(lt, key, False)
        try:
            if any(x.policy.accept_demotions for x in self._tiers[position + 1 :]):
                data = memoryview(bytearray(size))
                if self._call(lt, "read", False, lt.tier.read_into, key, data):
                    self.demote(key, data, below=position + 1)
            if self._call(lt, "delete", None, lt.tier.delete, key) is None:
                self._restore(lt, key, size)  # failed or marked down: still held there
                return False
        finally:
            self._release(lt, [key])
        self._metrics.evictions.labels(tier=lt.tier.name).inc()
        return True

    @contextmanager
    def _claim(self, lt: LowerTierState, keys: Sequence[ChunkKey]) -> Iterator[None]:
        """Hold ``keys`` in the tier for a put: wait while any has a put or an eviction in
        flight there. An eviction deletes its chunk after taking it out of the index, so a
        put of the same chunk in between (a demotion from above) would be indexed and then
        lose its file to that delete. All keys are taken at once (no hold-and-wait within a
        tier); a holder only ever waits on a tier further down."""
        with self._idle:
            self._idle.wait_for(lambda: lt.busy.isdisjoint(keys))
            lt.busy.update(keys)
        try:
            yield
        finally:
            self._release(lt, keys)

    def _release(self, lt: LowerTierState, keys: Sequence[ChunkKey]) -> None:
        with self._idle:
            lt.busy.difference_update(keys)
            self._idle.notify_all()

    def _restore(self, lt: LowerTierState, key: ChunkKey, size: int) -> None:
        """Put back the index entry of a chunk the tier failed to delete, least recent."""
        with self._lock:
            if key not in lt.contents:
                lt.contents[key] = size
                lt.contents.move_to_end(key, last=False)
                self._changed(lt, key, True)

    def delete(self, key: ChunkKey) -> bool:
        """Remove the chunk from every lower tier; True if one of them held it."""
        found = False
        with self._lock:
            self._deletes.record(key)
        for lt in self._tiers:
            with self._lock:
                size = lt.contents.pop(key, None)
                self._changed(lt, key, False)
            if size is None and not lt.tier.shared:
                continue
            deleted = self._call(lt, "delete", None, lt.tier.delete, key)
            if deleted is None:  # failed or marked down: still held and counted there
                if size is not None:
                    self._restore(lt, key, size)
                continue
            found = deleted > 0 or found
        return found

    def _report(self, tier: Tier, results: Sequence[ItemResult]) -> None:
        """Log and count each distinct error of a batch (one for a batch that failed whole)."""
        errors = {id(r.error): r.error for r in results if isinstance(r, Failed)}
        for error in errors.values():
            self._failed(tier, error)

    # -- faults ----------------------------------------------------------------------------

    def _call(
        self, lt: LowerTierState, op: str, default: D, fn: Callable[..., T], *args: Any
    ) -> T | D:
        """``fn(*args)`` on the tier through its breaker; ``default`` when skipped or failed.

        A caller's call is skipped unless the breaker is closed; once the backoff is over it
        starts the probe in the background and still answers at once (a miss), so no caller
        waits on a tier that may still hang. A batch (``put_many``, ``read_many_into``)
        reports failures per item instead of raising: one whose every item failed, none as
        corrupted, is a failure of the tier."""
        allowed = lt.breaker.allow_probe() if op == "probe" else lt.breaker.allow()
        if not allowed:
            self._metrics.tier_skips.labels(tier=lt.tier.name, op=op).inc()
            if op != "probe":
                self._probe_soon(lt)
            return default
        try:
            if op in _QUICK_OPS:
                with lt.breaker.track():
                    result = fn(*args)
            else:
                result = fn(*args)
        except Corrupted as e:  # the tier answered; the bytes were bad (and are dropped)
            self._failed(lt.tier, e)
            self._answered(lt)
            return default
        except TierError as e:
            self._failed(lt.tier, e)
            lt.breaker.failure()
            return default
        if _failed_whole(result):
            lt.breaker.failure()  # the caller reports the items' errors
            return result
        self._answered(lt)
        return result

    def probe_down_tiers(self) -> None:
        """Probe each tier marked down whose backoff is over, on a thread of its own, so a
        tier comes back (and its index is resynced) without waiting for traffic."""
        for lt in self._tiers:
            self._probe_soon(lt)

    def _probe_soon(self, lt: LowerTierState) -> None:
        """Start the tier's probe on a thread of its own if its backoff is over (one probe
        at a time): callers and the maintenance thread ask, neither waits."""
        if not lt.breaker.probe_due():
            return
        with self._lock:
            if lt.tier.name in self._probing:
                return
            self._probing.add(lt.tier.name)
        threading.Thread(
            target=self._probe, args=(lt,), name=f"lmcache-svc-probe-{lt.tier.name}",
            daemon=True,
        ).start()  # fmt: skip

    def _probe(self, lt: LowerTierState) -> None:
        try:
            self._call(lt, "probe", None, lt.tier.contains_many, [_PROBE_KEY])
        finally:
            with self._lock:
                self._probing.discard(lt.tier.name)

    def _answered(self, lt: LowerTierState) -> None:
        if lt.breaker.success():
            log.warning("tier %s is back; rebuilding its index from what it holds", lt.tier.name)
            self._start_resync(lt)
        elif lt.tier.generation != lt.generation:
            log.warning("tier %s was replaced (restarted); rebuilding its index", lt.tier.name)
            self._start_resync(lt)

    def _start_resync(self, lt: LowerTierState) -> None:
        with self._lock:
            if lt.tier.name in self._resyncing:
                return
            self._resyncing.add(lt.tier.name)
        threading.Thread(
            target=self._resync, args=(lt,), name=f"lmcache-svc-resync-{lt.tier.name}", daemon=True
        ).start()

    def _resync(self, lt: LowerTierState) -> None:
        """Make the index (and the tier's accounting) agree with what the tier holds after an
        outage: exactly what ``rescan`` finds, known chunks keeping their LRU order. A chunk
        written during the scan that the scan missed leaves the index; for a shared tier a
        local miss is still confirmed with the tier, so it is found anyway."""
        try:
            lt.generation = lt.tier.generation  # a later change resyncs again
            found = dict(lt.tier.rescan())
            with self._lock:
                new = [k for k in found if k not in lt.contents]
            self._describe_found(lt, new)
            with self._lock:
                gone = sum(1 for k in lt.contents if k not in found)
                index = OrderedDict((k, found[k]) for k in lt.contents if k in found)
                for key, size in found.items():
                    index.setdefault(key, size)
                lt.contents = index
                if self._listener is not None:
                    self._listener.tier_contents(lt.tier, list(index))
            self._metrics.resyncs.labels(tier=lt.tier.name).inc()
            log.info(
                "tier %s resynced: %d chunks found, %d known chunks gone",
                lt.tier.name, len(found), gone,
            )  # fmt: skip
        except TierError as e:
            if self._closing:
                return  # the tiers were closed under the scan: the server stops
            self._failed(lt.tier, e)
            lt.breaker.failure()
        finally:
            with self._lock:
                self._resyncing.discard(lt.tier.name)

    def _describe_found(self, lt: LowerTierState, keys: list[ChunkKey]) -> None:
        """Read the descriptions of ``keys`` (the last ``max_described``: the most recently
        used) from the tier's values and hand them to the listener; a tier that fails is
        left alone (its chunks are loadable, just not announced)."""
        listener = self._listener
        if listener is None or not keys:
            return
        keys = keys[-listener.max_described :]
        try:
            descriptions = lt.tier.describe_many(keys)
        except TierError as e:
            log.warning("tier %s: its chunks' descriptions could not be read: %s", lt.tier.name, e)
            return
        found = [(k, d) for k, d in zip(keys, descriptions) if d is not None]
        if found:
            listener.chunks_found(lt.tier, found)

    def _changed(self, lt: LowerTierState, key: ChunkKey, loadable: bool) -> None:
        if self._listener is not None:
            self._listener.chunk_changed(lt.tier, key, loadable)

    def _failed(self, tier: Tier, error: TierError) -> None:
        log.warning("tier %s failed: %s", tier.name, error)
        self._metrics.errors.labels(kind=error.kind).inc()
        self._metrics.tier_errors.labels(tier=tier.name, kind=error.kind).inc()

    def close(self) -> None:
        self._closing = True  # a resync still scanning on its thread ends quietly
        for lt in self._tiers:
            lt.tier.close()


def _gone(result: ItemResult) -> bool:
    """Whether a read's result means the tier no longer holds the chunk: absent, or dropped
    as corrupted. After any other failure the tier still holds (and counts) it, so the index
    keeps it, to be read again or evicted later."""
    return result is False or (isinstance(result, Failed) and isinstance(result.error, Corrupted))


def _failed_whole(result: object) -> bool:
    """Whether ``result`` is a batch's per-item results with every item failed by the tier
    (a corrupted item means the tier answered)."""
    return (
        isinstance(result, list)
        and bool(result)
        and all(isinstance(r, Failed) and not isinstance(r.error, Corrupted) for r in result)
    )


def _up(lt: LowerTierState) -> bool:
    """Not marked down: a tier whose breaker is open or probing counts as a miss."""
    return lt.breaker.state == "closed"

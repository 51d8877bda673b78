"""A pool of shared-memory slots reserved ahead of the chunks written into them.

A store through ``prepare_store`` waits for a round trip before its first copy. A pool
reserves slots in the background under random placeholder hashes (ordinary reservations of
the client's session: they count against its ``max_reserved_fraction``, expire and are
quarantined like any other, and are given back when the session ends); a store takes slots
from it at once, copies, and ``bind`` commits each slot as the chunk written into it
(``CommitStore`` with ``reserved_as``). The server checks at that moment that the
reservation is still the session's and not past its deadline (else nothing is published),
and that the chunk is not stored or being stored already (else the placeholder stays
reserved and comes back to the pool).

The pool holds twice as many slots as the largest store taken from it asked for (at most
``max_slots``), refilled on a background thread after each store the server answered (so a
server that is down is not asked by the pool too): a store that follows another at once,
before that one's bind and refill have come back, still finds its slots (with one store's
worth, every second store of a burst paid a ``prepare_store`` round trip before its
copies). A slot is used only in the first half of its reservation's lifetime; older ones
are aborted at the next refill. A bind that fails (no answer from a hung or restarted
server, or refused) leaves its slots out of the pool for good: they are aborted at the next
refill or at ``close`` (a placeholder the server did bind is unknown to it by then, so the
chunk is untouched); before, each stayed reserved, then quarantined, against the session's
limit until the session ended. Thread-safe.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from lmcache_svc.client import CacheClient
from lmcache_svc.errors import LMCacheSvcError

log = logging.getLogger(__name__)

REFILL_BATCH = 32
"""Most placeholders reserved by one PrepareStore of a refill."""


@dataclass(frozen=True, slots=True, eq=False)  # compared by identity, never by bytes
class PooledSlot:
    placeholder: bytes
    buffer: memoryview
    session_id: str
    use_by: float
    """Monotonic time after which the slot is not handed out (half its reservation TTL)."""


class StorePool:
    def __init__(
        self,
        client: CacheClient,
        namespace_id: bytes,
        *,
        max_slots: int = 64,
        ttl_s: float = 30.0,
    ) -> None:
        if max_slots < 1 or ttl_s <= 0:
            raise ValueError(f"max_slots must be >= 1 and ttl_s > 0, got {max_slots}, {ttl_s}")
        self._client = client
        self._namespace_id = namespace_id
        self.max_slots = max_slots
        self.ttl_s = ttl_s
        self.target = 0
        """Slots the pool keeps: twice the largest take so far, at most ``max_slots``."""
        self._slots: deque[PooledSlot] = deque()
        self._lock = threading.Lock()
        self._refiller = ThreadPoolExecutor(1, thread_name_prefix="lmcache-svc-pool")
        self._refill_queued = False
        self._refilling = threading.Lock()  # one refill at a time
        self._closed = False
        self._unanswered: list[PooledSlot] = []
        """Written slots whose bind got no answer: aborted at the next refill."""

    @property
    def num_slots(self) -> int:
        with self._lock:
            return len(self._slots)

    # -- stores ----------------------------------------------------------------------------

    def take(self, num: int) -> list[PooledSlot]:
        """Up to ``num`` slots of the open session, at once (no call to the server). The
        pool is refilled in the background after a bind (or ``refill_soon``): only once the
        server has answered, so a server that is down is not asked by the pool too."""
        session_id = self._client.session_id
        now = time.monotonic()
        out: list[PooledSlot] = []
        with self._lock:
            self.target = min(self.max_slots, max(self.target, 2 * num))
            while self._slots and len(out) < num:
                slot = self._slots.popleft()
                if slot.session_id == session_id and slot.use_by > now:
                    out.append(slot)
                else:
                    self._slots.append(slot)  # stale: aborted by the next refill
                    break
        return out

    def bind(self, chunk_hashes: Sequence[bytes], slots: Sequence[PooledSlot]) -> int:
        """Commit ``chunk_hashes[i]``, written into ``slots[i]``; returns chunks committed.
        Slots whose chunk the server had already go back to the pool."""
        if not slots:
            return 0
        try:
            num, kept = self._client.bind_store(
                self._namespace_id, chunk_hashes, [s.placeholder for s in slots]
            )
        except LMCacheSvcError:  # bound or not: never handed out again; aborted later
            with self._lock:
                self._unanswered.extend(slots)
            raise
        self.refill_soon()  # the server answered: top the pool up
        if kept:
            by_placeholder = {s.placeholder: s for s in slots}
            self._give_back([by_placeholder[k] for k in kept if k in by_placeholder])
        return num

    def abort(self, slots: Sequence[PooledSlot]) -> None:
        """Slots not written after all (a failed copy): back to the pool, still reserved."""
        self._give_back(slots)

    def _give_back(self, slots: Sequence[PooledSlot]) -> None:
        with self._lock:
            if not self._closed:
                self._slots.extendleft(reversed(slots))
                return
        self._abort_quietly(slots)

    # -- refills ---------------------------------------------------------------------------

    def refill_soon(self) -> None:
        """Queue a refill on the pool's thread unless one is queued already."""
        with self._lock:
            if self._refill_queued or self._closed:
                return
            self._refill_queued = True
        self._refiller.submit(self._refill_logged)

    def _refill_logged(self) -> None:
        with self._lock:
            self._refill_queued = False
        try:
            self.refill()
        except LMCacheSvcError as e:  # the next take falls back to prepare_store
            log.debug("store pool refill failed: %s", e)
        except Exception:  # never into the caller's thread: the pool just stays short
            log.exception("store pool refill failed unexpectedly")

    def refill(self) -> int:
        """Abort stale slots, then reserve up to ``target``; returns the slots added. Stops
        at the first chunk the server has no room for; raises what the server refused."""
        with self._refilling:
            return self._refill()

    def _refill(self) -> int:
        self._abort_quietly(self._drop_stale())
        self._abort_unanswered()
        added = 0
        while True:
            with self._lock:
                missing = self.target - len(self._slots)
                if self._closed or missing <= 0:
                    return added
            placeholders = [secrets.token_bytes(32) for _ in range(min(missing, REFILL_BATCH))]
            use_by = time.monotonic() + self.ttl_s / 2
            prepared = self._client.prepare_store(
                self._namespace_id, placeholders, ttl_s=self.ttl_s
            )
            session_id = self._client.session_id or ""
            fresh = [
                PooledSlot(p.chunk_hash, p.buffer, session_id, use_by)
                for p in prepared
                if p.status == "reserved" and p.buffer is not None
            ]
            with self._lock:
                closed = self._closed
                if not closed:
                    self._slots.extend(fresh)
            if closed:
                self._abort_quietly(fresh)
                return added
            added += len(fresh)
            if len(fresh) < len(placeholders):
                return added

    def _drop_stale(self) -> list[PooledSlot]:
        session_id = self._client.session_id
        now = time.monotonic()
        with self._lock:
            stale = [s for s in self._slots if s.session_id != session_id or s.use_by <= now]
            if stale:
                self._slots = deque(
                    s for s in self._slots if s.session_id == session_id and s.use_by > now
                )
        return [s for s in stale if s.session_id == session_id]  # others died with theirs

    def _abort_unanswered(self) -> None:
        """Abort the slots of binds that got no answer (a hung or restarted server). Their
        writer is done; a placeholder the server bound after all is unknown to it now, so
        the abort does nothing to the chunk. Otherwise each would stay reserved (then
        quarantined) against the session's limit until the session ends."""
        session_id = self._client.session_id
        with self._lock:
            slots, self._unanswered = self._unanswered, []
        mine = [s for s in slots if s.session_id == session_id]  # others died with theirs
        if mine and not self._abort_quietly(mine):
            with self._lock:
                self._unanswered.extend(mine)

    def _abort_quietly(self, slots: Sequence[PooledSlot]) -> bool:
        if not slots:
            return True
        try:
            self._client.commit_store(
                self._namespace_id, [s.placeholder for s in slots], abort=True
            )
        except LMCacheSvcError as e:  # they expire and are given back at session end
            log.debug("aborting %d pooled slots failed: %s", len(slots), e)
            return False
        return True

    def close(self) -> None:
        """Give every pooled slot back (best effort) and stop the refill thread."""
        with self._lock:
            self._closed = True
            slots, self._slots = list(self._slots), deque()
        self._refiller.shutdown(wait=True, cancel_futures=True)
        self._abort_quietly([s for s in slots if s.session_id == self._client.session_id])
        self._abort_unanswered()

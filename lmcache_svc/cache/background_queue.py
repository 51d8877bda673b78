"""A queue and the background thread that works through it in batches: one instance copies
committed chunks to write-through tiers, a second takes the checksums of committed and
promoted chunks.

Only the mechanics live here (a queue, a thread, batching, pacing, flush); what a copy does
is the cache's ``copy_batch`` callback, so the policy stays in one place.

Pacing (``Pace``, the checksum queue's): a batch starts only once no key has been submitted
for ``quiet_s`` (the chunks keep coming: the client is still copying the next ones into the
arena, and on a small machine the work would slow those copies), or once its oldest key has
waited ``max_delay_s``, or at once while ``flush`` or ``stop`` waits. Work is only moved,
never dropped: everything submitted is done, at the latest ``max_delay_s`` plus the work
ahead of it after its submission.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lmcache_svc.keys import ChunkKey

log = logging.getLogger(__name__)

_MAX_BATCH = 64


@dataclass(frozen=True, slots=True)
class Pace:
    quiet_s: float
    """A batch waits until no key has been submitted for this long ..."""
    max_delay_s: float
    """... or until its oldest key has waited this long."""


class BackgroundQueue:
    def __init__(
        self,
        copy_batch: Callable[[list[ChunkKey]], None],
        *,
        enabled: bool,
        name: str = "write-through",
        pace: Pace | None = None,
        max_batch: int = _MAX_BATCH,
    ) -> None:
        self._copy_batch = copy_batch
        self.enabled = enabled
        self._name = name
        self._pace = pace
        self._max_batch = max_batch
        self._items: deque[tuple[ChunkKey, float]] = deque()  # (key, submitted at)
        self._cond = threading.Condition()
        self._last_submit = 0.0
        self._num_pending = 0  # queued or in a batch being worked on
        self._num_hurrying = 0  # flushes waiting: no pacing meanwhile
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.enabled and self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(
                target=self._run, name=f"lmcache-svc-{self._name}", daemon=True
            )
            self._thread.start()

    def submit(self, keys: Sequence[ChunkKey]) -> None:
        if not (self.enabled and self._thread is not None and keys):
            return
        now = time.monotonic()
        with self._cond:
            self._items.extend((key, now) for key in keys)
            self._num_pending += len(keys)
            self._last_submit = now
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Work through everything queued now, unpaced; False if not done in ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._num_hurrying += 1
            self._cond.notify_all()
            try:
                while self._num_pending:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._num_hurrying -= 1

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish what is queued (unpaced), then stop the thread."""
        if self._thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self._thread = None

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._copy_batch(batch)
            except Exception:
                log.exception("%s of %d chunks failed", self._name, len(batch))
            finally:
                with self._cond:
                    self._num_pending -= len(batch)
                    self._cond.notify_all()

    def _next_batch(self) -> list[ChunkKey] | None:
        """The next keys to work on, once the pace allows; None when stopped and drained."""
        with self._cond:
            while True:
                if not self._items:
                    if self._stopping:
                        return None
                    self._cond.wait()
                    continue
                wait_s = self._wait_s(time.monotonic())
                if wait_s <= 0:
                    num = min(self._max_batch, len(self._items))
                    return [self._items.popleft()[0] for _ in range(num)]
                self._cond.wait(wait_s)

    def _wait_s(self, now: float) -> float:
        """How long the pace holds the next batch back (0: start it now)."""
        if self._pace is None or self._num_hurrying or self._stopping:
            return 0.0
        quiet = self._last_submit + self._pace.quiet_s - now
        overdue = self._items[0][1] + self._pace.max_delay_s - now
        return max(0.0, min(quiet, overdue))

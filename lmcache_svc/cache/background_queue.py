"""A queue and the background thread that works through it in batches: one instance copies
committed chunks to write-through tiers, a second takes the checksums of committed and
promoted chunks.

Only the mechanics live here (a queue, a thread, batching, flush); what a copy does is the
cache's ``copy_batch`` callback, so the policy stays in one place.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

from lmcache_svc.keys import ChunkKey

log = logging.getLogger(__name__)

_MAX_BATCH = 64


class BackgroundQueue:
    def __init__(
        self,
        copy_batch: Callable[[list[ChunkKey]], None],
        *,
        enabled: bool,
        name: str = "write-through",
    ) -> None:
        self._copy_batch = copy_batch
        self.enabled = enabled
        self._name = name
        self._queue: queue.Queue[ChunkKey | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"lmcache-svc-{self._name}", daemon=True
            )
            self._thread.start()

    def submit(self, keys: Sequence[ChunkKey]) -> None:
        if self.enabled and self._thread is not None:
            for key in keys:
                self._queue.put(key)

    def flush(self, timeout_s: float) -> bool:
        """Wait for the queue to drain; False if it did not within ``timeout_s``."""
        done = threading.Event()

        def wait() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        return done.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish what is queued, then stop the thread."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._thread = None

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < _MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            keys = [k for k in batch if k is not None]
            try:
                if keys:
                    self._copy_batch(keys)
            except Exception:
                log.exception("%s of %d chunks failed", self._name, len(keys))
            finally:
                for _ in batch:
                    self._queue.task_done()
            if len(keys) < len(batch):
                return

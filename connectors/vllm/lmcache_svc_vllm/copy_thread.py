"""CPU loads beside the forward pass: one copy thread and the per-layer events it sets.

On the CPU a load's copies used to run in ``start_load_kv``, before the forward pass, so a
hit's first token waited for every layer's copy. vLLM waits for a layer's KV only just
before that layer's attention (``wait_for_layer_load``), so a big load hands its layers to
a ``CopyThread``, off the cores vLLM bound the forward pass to (``cores.py``): layer 0
copies while the forward pass embeds the tokens and projects layer 0's queries, layer 1
while layer 0 computes, and so on. numpy releases the GIL while it copies.

Each layer's ``ThreadEvent`` is set once that layer's copies are done (or failed). On the
CPU the host is the device, so waiting "on the device" blocks the caller; it never raises
into the forward pass: a failed copy raises from ``synchronize``, where the worker turns it
into blocks that vLLM recomputes.

Both run on a hit's path, on a cold CPU (an engine idle between requests), where each
Python call costs microseconds: an event is a bare lock and a load is handed over through
a bare queue, all in C, rather than ``threading.Event`` and a ``ThreadPoolExecutor`` (about
40 Python calls for a 4-layer load; the hand-over took 118-128 us cold with them, 55-66 us
without: docs/benchmarks.md, 2026-11-28).
"""

from __future__ import annotations

import _thread
import logging
import threading
from collections.abc import Callable, Sequence
from queue import SimpleQueue

from lmcache_svc_vllm import trace
from lmcache_svc_vllm.cores import off_compute_cores

logger = logging.getLogger(f"vllm.{__name__}")


class CopyFailed(RuntimeError):
    """A layer's copies on the copy thread raised; its blocks hold no valid KV."""


class ThreadEvent:
    """A point on the copy thread: set once the copies before it are done or failed.

    A lock held from its creation until ``set`` (a plain lock may be released by another
    thread); a waiter takes it and gives it back at once, so any number may wait."""

    __slots__ = ("_held", "_error")

    def __init__(self) -> None:
        self._held = _thread.allocate_lock()
        self._held.acquire()
        self._error: BaseException | None = None

    def set(self, error: BaseException | None = None) -> None:
        """Once only (the copy thread sets each event once)."""
        self._error = error
        self._held.release()

    def synchronize(self) -> None:
        """Wait for the copies; raise ``CopyFailed`` if they failed."""
        self.wait_on_device()
        if self._error is not None:
            raise CopyFailed(f"copy on the copy thread failed: {self._error!r}") from self._error

    def wait_on_device(self) -> None:
        """The forward pass's wait: until the copies are done (never raises into vLLM)."""
        held = self._held
        held.acquire()
        held.release()

    def query(self) -> bool:
        return not self._held.locked()


class CopyThread:
    """Runs layer copies in submission order on one thread off the compute cores."""

    def __init__(self) -> None:
        self._jobs: SimpleQueue[Callable[[], None] | None] = SimpleQueue()
        self._lock = threading.Lock()  # submissions against shutdown
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="lmcache-svc-copy", daemon=True)
        self._thread.start()  # now, not on a request's path

    def _run(self) -> None:
        off_compute_cores()
        while (job := self._jobs.get()) is not None:
            try:
                job()  # copy_layers' jobs catch their copies' errors themselves
            except Exception:  # a bug: keep the thread for the loads after it
                logger.exception("lmcache-svc: a job on the copy thread failed")

    def copy_layers(
        self, copy_layer: Callable[[int], None], layers: Sequence[int]
    ) -> list[ThreadEvent]:
        """Call ``copy_layer(layer)`` for each of ``layers`` in order on the thread; one
        event per layer, set after its copy. A copy that raises fails its layer and every
        later one (they are not attempted). Raises ``RuntimeError`` after ``shutdown``."""
        events = [ThreadEvent() for _ in layers]

        def run() -> None:
            for i, (layer, event) in enumerate(zip(layers, events)):
                try:
                    copy_layer(layer)
                except BaseException as e:  # every waiter must wake: fail the rest
                    logger.exception("lmcache-svc: copying layer %d on the copy thread", layer)
                    for later in events[i:]:
                        later.set(e)
                    return
                event.set()
            trace.mark("load.copied")

        with self._lock:
            if self._closed:
                raise RuntimeError("the copy thread is shut down")
            self._jobs.put(run)
        return events

    def shutdown(self) -> None:
        """Finish the copies submitted so far, then stop the thread."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._jobs.put(None)
        self._thread.join()

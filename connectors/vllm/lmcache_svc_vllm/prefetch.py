"""Leases taken while vLLM prepares the step, for a worker in the scheduler's process.

With one worker (vLLM's ``UniProcExecutor``, the default for one device and on the CPU
backend) the scheduler half and the worker half of the connector live in one process.
There, once the scheduler has given a request its blocks (``update_state_after_alloc``), it
starts the load's lease (``PrepareLoad``, one round trip to the server) on the worker's
own link, on its lookup thread: the call overlaps what vLLM does between scheduling and
the forward pass, and the worker's ``start_load_kv`` takes the lease ready-made instead of
making the call on the request's path.

A worker in another process never attaches here, so the scheduler starts nothing and the
worker leases as before. A lease the worker does not take (the request was preempted or
finished first, or the plan changed) is released in the background; one the worker takes
is released by the worker after its copies, as any other. With ``pretouch_loads`` the
lease's pages are read once before the lease is handed over (``pretouch.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from lmcache_svc_vllm import trace
from lmcache_svc_vllm.link import Acquired, ServerLink
from lmcache_svc_vllm.pretouch import PageToucher

logger = logging.getLogger(f"vllm.{__name__}")

Submit = Callable[..., "Future[Any]"]


@dataclass(frozen=True, slots=True)
class _Pending:
    link: ServerLink
    hashes: tuple[bytes, ...]
    future: Future[Acquired | None]
    submit: Submit  # where its release runs (never on the thread that gives it up)


class Prefetches:
    """One process's workers (by namespace id) and the leases started for them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._workers: dict[bytes, ServerLink] = {}
        self._pending: dict[str, _Pending] = {}
        self._toucher = PageToucher()

    def attach(self, namespace_id: bytes, link: ServerLink) -> None:
        """A worker of this process loads ``namespace_id`` through ``link``."""
        with self._lock:
            self._workers[bytes(namespace_id)] = link

    def detach(self, namespace_id: bytes) -> None:
        with self._lock:
            self._workers.pop(bytes(namespace_id), None)
            gone = [k for k, p in self._pending.items() if p.link.namespace.namespace_id
                    == namespace_id]  # fmt: skip
            pending = [self._pending.pop(k) for k in gone]
        for p in pending:
            _release_when_done(p)

    def start(
        self, req_id: str, namespace_id: bytes, hashes: Sequence[bytes], submit: Submit
    ) -> bool:
        """Start the lease of ``hashes`` for ``req_id`` with ``submit`` (a thread pool's) if
        a worker of this process loads that namespace; whether one was started."""
        with self._lock:
            link = self._workers.get(bytes(namespace_id))
        if link is None or not hashes:
            return False
        if link.config.pretouch_loads:
            future = submit(self._acquire_touched, link, list(hashes))
        else:
            future = submit(link.acquire, list(hashes))
        pending = _Pending(link, tuple(hashes), future, submit)
        with self._lock:
            old = self._pending.pop(req_id, None)
            self._pending[req_id] = pending
        if old is not None:
            _release_when_done(old)
        return True

    def _acquire_touched(self, link: ServerLink, hashes: list[bytes]) -> Acquired | None:
        """On the pool's thread: the lease, its pages read once before its future completes
        (so before anyone can take it, and never after its release)."""
        acquired = link.acquire(hashes)
        if acquired is not None and self._toucher.touch(acquired.buffers) is not None:
            trace.mark("load.pretouched")
        return acquired

    def take(self, req_id: str, hashes: Sequence[bytes], timeout_s: float) -> Acquired | None:
        """The lease started for ``req_id`` if it covers exactly ``hashes``, once it is there;
        None if there is none (or it failed, or came too late): the caller leases itself."""
        with self._lock:
            pending = self._pending.pop(req_id, None)
        if pending is None:
            return None
        if pending.hashes != tuple(hashes):
            _release_when_done(pending)
            return None
        try:
            return pending.future.result(timeout=timeout_s)
        except FutureTimeout:
            _release_when_done(pending)
            return None
        except Exception:  # never into vLLM: the worker leases itself
            logger.exception("lmcache-svc: a lease started ahead failed")
            return None

    def discard(self, req_id: str) -> None:
        """The request is gone: release its lease if the worker never took it."""
        with self._lock:
            pending = self._pending.pop(req_id, None)
        if pending is not None:
            _release_when_done(pending)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)


def _release_when_done(pending: _Pending) -> None:
    """Release the lease once its call returned, on the pool that made the call."""

    def release(future: Future[Acquired | None]) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        acquired = future.result()
        if acquired is None:
            return
        try:
            pending.submit(pending.link.release, acquired)
        except RuntimeError:  # the pool is shut down: the session's end releases it
            logger.debug("lmcache-svc: a lease started ahead was not released", exc_info=True)

    pending.future.add_done_callback(release)


PREFETCHES = Prefetches()
"""This process's: the scheduler half and the worker half of one engine meet here."""

"""Lookups the client answers from the shared-memory lookup index, counted here and reported
to the server so that its lookup counters (``lmcache_svc_lookup_*``) count them too.

Per namespace, the client adds up the lookups it answered itself, the chunks they asked
about and the chunks of their hit prefixes. A background thread, started by the first such
lookup, sends what accumulated every ``interval_s`` seconds (one ``ReportLookups`` call per
namespace with something new, never one per lookup); ``close`` sends the rest. So the
server's counters include an index-answered lookup at most ``interval_s`` (plus a report's
deadline, ``REPORT_TIMEOUT_S``) after it happened. A report the server cannot take now
(``ServerUnavailable``) is kept and sent with the next; one it refuses is dropped, with a
warning the first time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from lmcache_svc import errors

log = logging.getLogger(__name__)

DEFAULT_REPORT_INTERVAL_S = 5.0
"""How often a client reports its index-answered lookups (``docs/metrics.md``)."""
REPORT_TIMEOUT_S = 1.0
"""A report's deadline (at most the client's ``timeout_s``)."""


@dataclass(slots=True)
class LookupCounts:
    """What the lookups a client answered from the index asked and found, since a report."""

    num_lookups: int = 0
    num_chunks: int = 0
    num_hit_chunks: int = 0

    def add(self, other: LookupCounts) -> None:
        self.num_lookups += other.num_lookups
        self.num_chunks += other.num_chunks
        self.num_hit_chunks += other.num_hit_chunks


SendReport = Callable[[bytes, LookupCounts], None]
"""Sends one namespace's counts to the server (raises the project's exceptions)."""


class LookupReporter:
    """Counts index-answered lookups per namespace and reports them. Thread-safe."""

    def __init__(self, send: SendReport, *, interval_s: float = DEFAULT_REPORT_INTERVAL_S) -> None:
        if interval_s <= 0:
            raise errors.InvalidArgument(f"report interval must be > 0 s, got {interval_s}")
        self._send = send
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._pending: dict[bytes, LookupCounts] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._send_lock = threading.Lock()  # one report of a namespace in flight at a time
        self._warned = False

    def count(self, namespace_id: bytes, num_chunks: int, num_hit_chunks: int) -> None:
        """One lookup answered from the index (starts the reporting thread if need be)."""
        with self._lock:  # on the lookup path: no allocation once the namespace is known
            counts = self._pending.get(namespace_id)
            if counts is None:
                counts = self._pending[bytes(namespace_id)] = LookupCounts()
                self._start_locked()
            counts.num_lookups += 1
            counts.num_chunks += num_chunks
            counts.num_hit_chunks += num_hit_chunks

    def _start_locked(self) -> None:
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(
                target=self._run, name="lmcache-svc-lookup-reports", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.flush()
            except Exception:  # a bug: keep reporting, but say so
                log.exception("reporting index-answered lookups failed")

    def flush(self) -> int:
        """Send what accumulated; returns the lookups the server took."""
        with self._send_lock:
            with self._lock:
                pending, self._pending = self._pending, {}
            return sum(self._send_one(ns_id, counts) for ns_id, counts in pending.items())

    def _send_one(self, namespace_id: bytes, counts: LookupCounts) -> int:
        try:
            self._send(namespace_id, counts)
        except errors.ServerUnavailable:
            with self._lock:  # the next report carries them
                self._pending.setdefault(namespace_id, LookupCounts()).add(counts)
            return 0
        except errors.LMCacheSvcError as e:  # e.g. an older server without ReportLookups
            level = logging.DEBUG if self._warned else logging.WARNING
            self._warned = True  # once: a server that refuses one will refuse them all
            log.log(
                level,
                "the server refused a report of %d index-answered lookups of namespace %s "
                "(dropped): %s",
                counts.num_lookups,
                namespace_id.hex(),
                e,
            )
            return 0
        return counts.num_lookups

    def close(self) -> int:
        """Stop the thread and send the rest (returns the lookups the server took)."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join()
        return self.flush()

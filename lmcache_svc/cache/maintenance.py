"""The tiered cache's lifecycle and background maintenance: the maintenance thread (expiry of
leases and reservations, eviction to the low watermark, probes of tiers marked down), the
background queues (write-through copies, checksums) and their flush, and closing."""

from __future__ import annotations

import logging
import threading

from lmcache_svc.cache.core import CacheCore

log = logging.getLogger(__name__)


class Maintenance:
    def __init__(self, core: CacheCore) -> None:
        self._core = core
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start background maintenance (expiry, watermark eviction) and write-through."""
        self._thread = threading.Thread(
            target=self._maintain, name="lmcache-svc-maintenance", daemon=True
        )
        self._thread.start()
        self._core.write_through.start()
        self._core.checksummer.start()

    def close(self) -> None:
        """Stop background work, finish queued write-throughs, close every tier."""
        core = self._core
        core.stop.set()
        core.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        core.write_through.stop()
        core.checksummer.stop()
        if core.lookup_index is not None:
            with core.lock:
                core.lookup_index.close()
        core.first.close()
        core.lower.close()

    def _maintain(self) -> None:
        core = self._core
        while not core.stop.is_set():
            core.wake.wait(core.settings.maintenance_interval_s)
            core.wake.clear()
            try:
                self.reap_expired()
                self.evict_to_watermark()
                core.lower.probe_down_tiers()
            except Exception:  # keep the thread alive; the error is logged and counted
                log.exception("maintenance step failed")
                core.metrics.errors.labels(kind="maintenance").inc()

    def evict_to_watermark(self) -> int:
        """Evict from the first tier until it is under the low watermark; returns chunks."""
        first, settings = self._core.first, self._core.settings
        if first.used_bytes <= settings.high_watermark * first.capacity_bytes:
            return 0
        target = first.used_bytes - int(settings.low_watermark * first.capacity_bytes)
        return self._core.moves.evict(target)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write-through copy and checksum is done; False on timeout."""
        core = self._core
        return core.checksummer.flush(timeout_s) and core.write_through.flush(timeout_s)

    def reap_expired(self, now: float | None = None) -> int:
        """Release leases past their deadline and quarantine such reservations; returns
        how many."""
        num = self._core.sessions.reap_expired(now)
        self._core.update_pending()
        return num

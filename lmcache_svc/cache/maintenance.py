"""The tiered cache's lifecycle and background maintenance: the maintenance thread (expiry of
leases and reservations, eviction to the low watermark, probes of tiers marked down), the
background queues (write-through copies, checksums) and their flush, and closing."""

from __future__ import annotations

import logging
import threading

from lmcache_svc.cache.core import CacheCore

log = logging.getLogger(__name__)


class Maintenance(CacheCore):
    def start(self) -> None:
        """Start background maintenance (expiry, watermark eviction) and write-through."""
        self._maintenance = threading.Thread(
            target=self._maintain, name="lmcache-svc-maintenance", daemon=True
        )
        self._maintenance.start()
        self._write_through.start()
        self._checksummer.start()

    def close(self) -> None:
        """Stop background work, finish queued write-throughs, close every tier."""
        self._stop.set()
        self._wake.set()
        if self._maintenance is not None:
            self._maintenance.join(timeout=10)
        self._write_through.stop()
        self._checksummer.stop()
        if self.lookup_index is not None:
            with self._lock:
                self.lookup_index.close()
        self._first.close()
        self._lower.close()

    def _maintain(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.settings.maintenance_interval_s)
            self._wake.clear()
            try:
                self.reap_expired()
                self.evict_to_watermark()
                self._lower.probe_down_tiers()
            except Exception:  # keep the thread alive; the error is logged and counted
                log.exception("maintenance step failed")
                self.metrics.errors.labels(kind="maintenance").inc()

    def evict_to_watermark(self) -> int:
        """Evict from the first tier until it is under the low watermark; returns chunks."""
        first = self._first
        if first.used_bytes <= self.settings.high_watermark * first.capacity_bytes:
            return 0
        target = first.used_bytes - int(self.settings.low_watermark * first.capacity_bytes)
        return self._first_tier.evict(target)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write-through copy and checksum is done; False on timeout."""
        return self._checksummer.flush(timeout_s) and self._write_through.flush(timeout_s)

    def reap_expired(self, now: float | None = None) -> int:
        """Release leases past their deadline and quarantine such reservations; returns
        how many."""
        num = self._sessions.reap_expired(now)
        self._update_pending()
        return num

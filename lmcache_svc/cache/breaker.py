"""A circuit breaker for one lower tier: stop calling a tier that failed or stopped answering.

States: ``closed`` (calls go through), ``open`` (calls are skipped: the caller treats the
tier as a miss, or as an unavailable demotion target), ``half_open`` (one call, the probe,
is let through after the backoff; every other call is still skipped).

- A failed call (``failure()``) trips a closed breaker, and re-opens a half-open one with
  the backoff doubled, up to ``max_backoff_s``. A successful call (``success()``) closes it
  and resets the backoff to ``base_backoff_s``.
- A hung backend raises nothing until its socket timeout: so a call that has been in flight
  (``track()``) for longer than ``slow_call_s`` trips the breaker as soon as any other call
  asks ``allow()``. The slow call itself keeps waiting for its own result; only the others
  stop queueing behind it.

Thread-safe; time comes from ``clock`` (monotonic seconds) so tests can drive it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]
STATE_CODES: dict[BreakerState, int] = {"closed": 0, "open": 1, "half_open": 2}
"""The numeric form exported as a metric."""


class CircuitBreaker:
    def __init__(
        self,
        *,
        base_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        slow_call_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        on_trip: Callable[[], None] | None = None,
    ) -> None:
        if not 0 < base_backoff_s <= max_backoff_s:
            raise ValueError(
                f"backoffs must satisfy 0 < base ({base_backoff_s}) <= max ({max_backoff_s})"
            )
        if slow_call_s <= 0:
            raise ValueError(f"slow_call_s must be positive, got {slow_call_s}")
        self._base = base_backoff_s
        self._max = max_backoff_s
        self._slow = slow_call_s
        self._clock = clock
        self._on_trip = on_trip
        self._lock = threading.Lock()
        self._state: BreakerState = "closed"
        self._backoff = base_backoff_s
        self._retry_at = 0.0
        self._failed_since_trip = False
        self._in_flight: dict[int, float] = {}
        self._ids = itertools.count()
        self.trips = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    @property
    def backoff_s(self) -> float:
        with self._lock:
            return self._backoff

    def may_allow(self) -> bool:
        """Whether ``allow()`` could let a call through now (changes nothing)."""
        with self._lock:
            return self._state == "closed" or (
                self._state == "open" and self._clock() >= self._retry_at
            )

    def allow(self) -> bool:
        """Whether a call may go to the tier now (the first call after the backoff probes)."""
        with self._lock:
            now = self._clock()
            if self._state == "closed":
                if self._in_flight and now - min(self._in_flight.values()) > self._slow:
                    self._trip(now)
                    return False
                return True
            if self._state == "open" and now >= self._retry_at:
                self._state = "half_open"
                return True
            return False

    @contextmanager
    def track(self) -> Iterator[None]:
        """Mark a call in flight for the slow-call check."""
        call_id = next(self._ids)
        with self._lock:
            self._in_flight[call_id] = self._clock()
        try:
            yield
        finally:
            with self._lock:
                del self._in_flight[call_id]

    def success(self) -> bool:
        """The tier answered. True when this closes a breaker that had seen a failure (the
        tier recovered from an outage: what it holds may have changed meanwhile)."""
        with self._lock:
            recovered = self._state != "closed" and self._failed_since_trip
            self._state = "closed"
            self._backoff = self._base
            self._failed_since_trip = False
            return recovered

    def failure(self) -> None:
        """The tier failed (error or timeout)."""
        with self._lock:
            now = self._clock()
            if self._state == "closed":
                self._trip(now)
            elif self._state == "half_open":
                self._backoff = min(self._backoff * 2, self._max)
                self._state = "open"
                self._retry_at = now + self._backoff
            else:  # already open (tripped by a slow call): wait a full backoff from now
                self._retry_at = max(self._retry_at, now + self._backoff)
            self._failed_since_trip = True

    def _trip(self, now: float) -> None:
        self._state = "open"
        self._retry_at = now + self._backoff
        self.trips += 1
        if self._on_trip is not None:
            self._on_trip()

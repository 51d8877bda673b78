"""A circuit breaker for one lower tier: stop calling a tier that failed or stopped answering.

States: ``closed`` (calls go through), ``open`` (calls are skipped: the caller treats the
tier as a miss, or as an unavailable demotion target), ``half_open`` (one call, the probe,
is in flight after the backoff; every other call is still skipped).

- Callers' calls (``allow()``) go through only while the breaker is closed: a caller never
  probes, so it never waits on a tier that may still be hung; it answers from the breaker's
  state. The probe after the backoff is made by whoever owns the breaker, in the background
  (``probe_due()`` says it is time, ``allow_probe()`` lets exactly one through).
- A failed call (``failure()``) trips a closed breaker, and re-opens a half-open one with
  the backoff doubled, up to ``max_backoff_s``. A successful call (``success()``) closes it
  and resets the backoff to ``base_backoff_s``. The waits are a ``backoff.Backoff``.
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

from lmcache_svc.backoff import Backoff

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
        self._slow = slow_call_s
        self._clock = clock
        self._on_trip = on_trip
        self._lock = threading.Lock()
        self._state: BreakerState = "closed"
        self._backoff = Backoff(base_backoff_s, max_backoff_s, clock=clock)
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
            return self._backoff.delay_s

    def may_allow(self) -> bool:
        """Whether ``allow()`` could let a caller's call through now: closed (changes
        nothing)."""
        with self._lock:
            return self._state == "closed"

    def probe_due(self) -> bool:
        """Whether the backoff is over and no probe is in flight: time for ``allow_probe``."""
        with self._lock:
            return self._state == "open" and not self._backoff.waiting()

    def allow(self) -> bool:
        """Whether a caller's call may go to the tier now: only while closed (never a probe)."""
        with self._lock:
            if self._state != "closed":
                return False
            now = self._clock()
            if self._in_flight and now - min(self._in_flight.values()) > self._slow:
                self._trip()
                return False
            return True

    def allow_probe(self) -> bool:
        """The probe's call, once the backoff is over (half-open until it answers)."""
        with self._lock:
            if self._state == "open" and not self._backoff.waiting():
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
            self._backoff.succeeded()
            self._failed_since_trip = False
            return recovered

    def failure(self) -> None:
        """The tier failed (error or timeout)."""
        with self._lock:
            if self._state == "closed":
                self._trip()
            elif self._state == "half_open":
                self._state = "open"
                self._backoff.failed()  # the second failure on: doubled
            else:  # already open (tripped by a slow call): wait a full backoff from now
                self._backoff.postpone()
            self._failed_since_trip = True

    def _trip(self) -> None:
        self._state = "open"
        self._backoff.failed()  # closed until now: the first failure, ``base_backoff_s``
        self.trips += 1
        if self._on_trip is not None:
            self._on_trip()

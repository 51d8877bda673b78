"""Doubling backoff: after a failure, wait before trying again, twice as long each time.

Shared by the server's circuit breaker (``cache.breaker``) and the vLLM plugin's link to the
server (``lmcache_svc_vllm.link``). The first failure after a success waits ``base_s``; each
further failure doubles the wait, up to ``max_s``; a success starts over from ``base_s``.
The owner may end a wait early (``end_wait``) when it learns the other side changed.

Not thread-safe: the owner serialises its calls (the breaker under its lock) or tolerates
the outcome of a race (the plugin: two failures at once may double the wait once or twice).
Time comes from ``clock`` (monotonic seconds) so tests can drive it.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Backoff:
    """The wait after the latest failure (``delay_s``) and when it ends (``retry_at``)."""

    __slots__ = ("base_s", "max_s", "_clock", "_delay_s", "_retry_at", "_failing")

    def __init__(
        self, base_s: float, max_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not 0 <= base_s <= max_s:
            raise ValueError(f"backoff must satisfy 0 <= base ({base_s}) <= max ({max_s})")
        self.base_s = base_s
        self.max_s = max_s
        self._clock = clock
        self._delay_s = base_s
        self._retry_at = 0.0
        self._failing = False

    @property
    def delay_s(self) -> float:
        """The wait the latest failure started (``base_s`` before any, and after a success)."""
        return self._delay_s

    @property
    def retry_at(self) -> float:
        """The clock's time before which the owner does not try again."""
        return self._retry_at

    def waiting(self) -> bool:
        """Whether the wait is not over yet."""
        return self._clock() < self._retry_at

    def failed(self) -> float:
        """A failure: no try for ``delay_s`` from now, doubled first (up to ``max_s``)
        unless this is the first failure since a success. Returns the wait."""
        if self._failing:
            self._delay_s = min(2 * self._delay_s, self.max_s)
        self._failing = True
        self._retry_at = self._clock() + self._delay_s
        return self._delay_s

    def postpone(self) -> None:
        """No try for a full ``delay_s`` from now, the delay unchanged: a late failure of a
        try that already counted as failed (a slow call that tripped the breaker fails)."""
        self._retry_at = max(self._retry_at, self._clock() + self._delay_s)

    def end_wait(self, within_s: float = 0.0) -> None:
        """End a wait in progress ``within_s`` from now at the latest (at once by default):
        the owner learnt that a try may succeed sooner. The delay is kept, so a failure of
        that try doubles it (still the same outage)."""
        self._retry_at = min(self._retry_at, self._clock() + within_s)

    def succeeded(self) -> None:
        """A success: the next failure waits ``base_s`` again (a wait in progress stays)."""
        self._failing = False
        self._delay_s = self.base_s

"""A cap on memory transfers in flight (reads being streamed, uploads being received).

A read holds one piece at a time and an upload its body (at most ``memory.max_bytes``), so
the cap bounds what memory transfers can make the server hold, and how many files they keep
open. One over the cap is refused at once with ``TooBusy`` (429 / RESOURCE_EXHAUSTED), not
queued: a queued request would still hold its connection, and, for an upload, its body.
Thread-safe; the transports call it from their event loops and from threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from lmcache_svc.errors import InvalidArgument, TooBusy

DEFAULT_MAX_TRANSFERS = 8


class TransferLimiter:
    def __init__(self, limit: int = DEFAULT_MAX_TRANSFERS) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidArgument(f"memory.max_transfers must be a positive integer, got {limit!r}")
        self.limit = limit
        self._lock = threading.Lock()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def acquire(self, what: str) -> Callable[[], None]:
        """Take a slot for ``what`` (named in the refusal); returns its release, which may be
        called any number of times and gives the slot back once."""
        with self._lock:
            if self._in_flight >= self.limit:
                raise TooBusy(
                    f"{what} refused: {self._in_flight} memory transfers are in flight, the "
                    f"server's limit (memory.max_transfers); retry shortly"
                )
            self._in_flight += 1
        held = True

        def release() -> None:
            nonlocal held
            with self._lock:
                if held:
                    held = False
                    self._in_flight -= 1

        return release

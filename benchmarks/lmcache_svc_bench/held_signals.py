"""Ctrl-C and SIGTERM held off while a child process starts.

A benchmark stops the processes it started when Ctrl-C or SIGTERM unwinds it (``runner``).
But a signal that lands inside ``subprocess.Popen``, after the fork and before ``Popen``
returns, raises there: the child runs on and nothing holds its handle to stop it (seen
on a host short of CPU, where that window is widest). ``held_signals`` records such a
signal instead and raises it once the block is left, where the caller holds the handle.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

HELD = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def held_signals() -> Iterator[None]:
    """Defer SIGINT and SIGTERM until the block is left, then raise them (to the handlers
    they were meant for). Main thread only, where Python runs signal handlers; elsewhere
    a no-op (the signal interrupts the main thread, not this one)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        caught.append(signum)

    previous = {signum: signal.signal(signum, hold) for signum in HELD}
    try:
        yield
    finally:
        for held, handler in previous.items():
            signal.signal(held, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)

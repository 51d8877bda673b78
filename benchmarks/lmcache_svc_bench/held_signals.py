"""Ctrl-C and SIGTERM held off while a child process starts.

A benchmark stops the processes it started when Ctrl-C or SIGTERM unwinds it (``runner``).
But a signal that lands inside ``subprocess.Popen``, after the fork and before ``Popen``
returns, raises there: the child runs on and nothing holds its handle to stop it (seen
on a host short of CPU, where that window is widest). ``held_signals`` records such a
signal instead and raises it once the block is left, where the caller holds the handle.
``start_process`` does this for a caller with nothing to clean up but the child: a signal
held while the child starts kills it before it is raised.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

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


def start_process(args: Sequence[str | Path], **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(args, **kwargs)`` with SIGINT and SIGTERM held while it starts.
    One that lands meanwhile kills the child (its whole process group where it has one of
    its own: ``start_new_session``) and waits for it, then raises."""
    proc: subprocess.Popen[Any] | None = None
    try:
        with held_signals():
            proc = subprocess.Popen(args, **kwargs)
    except BaseException:
        if proc is not None:
            _kill(proc, own_group=bool(kwargs.get("start_new_session")))
        raise
    return proc


def _kill(proc: subprocess.Popen[Any], *, own_group: bool) -> None:
    try:
        if own_group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except ProcessLookupError:
        pass
    proc.wait()

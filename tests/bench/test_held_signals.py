"""Ctrl-C and SIGTERM landing while a benchmark starts a process: raised once its handle is
held, so the process is stopped with the rest (tests/bench/test_runner_signals.py failed on
a host short of CPU when SIGTERM landed inside ``Popen``: the server ran on)."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from lmcache_svc_bench import procs
from lmcache_svc_bench.held_signals import held_signals


def _exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@pytest.fixture
def sigterm_exits() -> Iterator[None]:
    """SIGTERM raises SystemExit, as the benchmark runner sets it (pytest's would end us)."""
    previous = signal.signal(signal.SIGTERM, _exit)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.usefixtures("sigterm_exits")
@pytest.mark.parametrize(
    ("signum", "raised"), [(signal.SIGTERM, SystemExit), (signal.SIGINT, KeyboardInterrupt)]
)
def test_a_signal_in_the_block_is_raised_when_it_is_left(
    signum: signal.Signals, raised: type[BaseException]
) -> None:
    after = []
    with pytest.raises(raised):
        with held_signals():
            signal.raise_signal(signum)
            after.append("the block ran on")
    assert after == ["the block ran on"]
    assert signal.getsignal(signal.SIGTERM) is _exit
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("sigterm_exits")
def test_without_a_signal_nothing_is_raised_and_the_handlers_come_back() -> None:
    with held_signals():
        assert signal.getsignal(signal.SIGTERM) is not _exit
    assert signal.getsignal(signal.SIGTERM) is _exit
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("sigterm_exits")
def test_sigterm_as_the_server_process_starts_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen_then_sigterm(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        signal.raise_signal(signal.SIGTERM)  # the signal lands before Popen returns
        return proc

    monkeypatch.setattr(procs.subprocess, "Popen", popen_then_sigterm)
    with pytest.raises(SystemExit):
        procs.start_server(tmp_path)
    (proc,) = started
    assert proc.poll() is not None, "the server runs on after SIGTERM"
    socket_path = proc.args[proc.args.index("--socket") + 1]
    assert not Path(socket_path).parent.exists()  # its directory removed

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
from lmcache_svc_bench.held_signals import held_signals, start_process
from tests.helpers import process_state, wait_until


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
    monkeypatch.setattr(subprocess, "Popen", _popen_then(signal.SIGTERM, started))
    with pytest.raises(SystemExit):
        procs.start_server(tmp_path)
    (proc,) = started
    assert proc.poll() is not None, "the server runs on after SIGTERM"
    socket_path = proc.args[proc.args.index("--socket") + 1]
    assert not Path(socket_path).parent.exists()  # its directory removed


def _popen_then(
    signum: signal.Signals, started: list[subprocess.Popen[bytes]], ready: Path | None = None
) -> Any:
    """``subprocess.Popen`` that raises ``signum`` before it returns (once ``ready`` exists):
    the signal lands while the child starts."""
    real_popen = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        if ready is not None:
            wait_until(ready.exists, 30, f"{ready} written by the child")
        signal.raise_signal(signum)
        return proc

    return popen


def test_a_signal_as_start_process_starts_a_child_kills_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[subprocess.Popen[bytes]] = []
    monkeypatch.setattr(subprocess, "Popen", _popen_then(signal.SIGINT, started))
    with pytest.raises(KeyboardInterrupt):
        start_process(["sleep", "60"])
    (proc,) = started
    assert proc.returncode == -signal.SIGKILL, "the child runs on after Ctrl-C"


def test_a_child_in_a_session_of_its_own_is_killed_with_its_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid_file = tmp_path / "grandchild.pid"
    started: list[subprocess.Popen[bytes]] = []
    monkeypatch.setattr(subprocess, "Popen", _popen_then(signal.SIGINT, started, pid_file))
    script = f"sleep 60 & echo $! > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}; wait"
    with pytest.raises(KeyboardInterrupt):
        start_process(["sh", "-c", script], start_new_session=True)
    grandchild = int(pid_file.read_text())
    # gone, or a zombie until init reaps it
    wait_until(lambda: process_state(grandchild) in (None, "Z"), 10, "the child's child ending")


def test_without_a_signal_start_process_returns_the_running_child() -> None:
    proc = start_process(["sleep", "60"])
    try:
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()

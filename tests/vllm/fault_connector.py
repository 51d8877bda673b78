"""The real connector plus one fault: signal the server between lookup and load.

Loaded by engines in ``tests/vllm`` as ``kv_connector_module_path: "fault_connector"``.
When the file named by ``$LMCACHE_SVC_TEST_KILL_FILE`` holds ``PID`` (SIGKILL) or
``PID STOP`` (SIGSTOP: the server hangs, its sockets stay open) and this step has loads,
the worker signals that process (the real server) right before the plugin leases the
chunks: the scheduler already promised vLLM a hit, so the load must fail and vLLM must
recompute. The file is then renamed to ``*.done``.

Second fault: while the file named by ``$LMCACHE_SVC_TEST_SLOW_COPY_FILE`` holds a number of
seconds, the worker's copy thread (``overlap_loads``) sleeps that long before each layer's
copy, so the forward pass reaches a layer before its KV is in place and must wait for it;
each delayed layer appends a line to ``<file>.layers``.
Nothing else differs from ``LMCacheSvcConnector``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmcache_svc_vllm.connector import LMCacheSvcConnector
from lmcache_svc_vllm.copy_thread import CopyThread

KILL_FILE_ENV = "LMCACHE_SVC_TEST_KILL_FILE"
SLOW_COPY_ENV = "LMCACHE_SVC_TEST_SLOW_COPY_FILE"


class FaultInjectingConnector(LMCacheSvcConnector):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._plan().loads:
            _kill_requested_process()
        super().start_load_kv(forward_context, **kwargs)


def _kill_requested_process() -> None:
    path = Path(os.environ.get(KILL_FILE_ENV, "/nonexistent"))
    try:
        request = path.read_text().split()
        pid, stop = int(request[0]), request[1:] == ["STOP"]
    except (OSError, ValueError, IndexError):
        return
    path.unlink()
    os.kill(pid, signal.SIGSTOP if stop else signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and not (_stopped(pid) if stop else _dead(pid)):
        time.sleep(0.01)
    path.with_suffix(".done").write_text(str(pid))


def _stopped(pid: int) -> bool:
    return _state(pid) in ("T", "t")


def _dead(pid: int) -> bool:
    """Every thread gone: the main thread shows "Z" while others still exit, holding the
    process's files (and so its segments' locks, which tell clients it is alive)."""
    if _state(pid) not in ("Z", "X", ""):
        return False
    try:
        return len(os.listdir(f"/proc/{pid}/task")) <= 1 and _state(pid) in ("Z", "X", "")
    except OSError:
        return True


def _state(pid: int) -> str:
    """The process's state letter (R, S, T: stopped, Z: zombie); "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _copy_delay_s() -> float:
    try:
        return float(Path(os.environ[SLOW_COPY_ENV]).read_text())
    except (KeyError, OSError, ValueError):
        return 0.0


_copy_layers = CopyThread.copy_layers


def _slow_copy_layers(
    self: CopyThread, copy_layer: Callable[[int], None], layers: Sequence[int]
) -> Any:
    delay_s = _copy_delay_s()
    if not delay_s:
        return _copy_layers(self, copy_layer, layers)

    def copy_late(layer: int) -> None:
        time.sleep(delay_s)
        copy_layer(layer)
        with open(os.environ[SLOW_COPY_ENV] + ".layers", "a") as delayed:
            delayed.write(f"{layer}\n")

    return _copy_layers(self, copy_late, layers)


CopyThread.copy_layers = _slow_copy_layers  # type: ignore[method-assign]

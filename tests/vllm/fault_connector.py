"""The real connector plus one fault: SIGKILL the server between lookup and load.

Loaded by an engine in ``test_vllm.py`` as ``kv_connector_module_path: "fault_connector"``.
When the file named by ``$LMCACHE_SVC_TEST_KILL_FILE`` holds a pid and this step has
loads, the worker kills that process (the real server) right before the plugin leases the
chunks: the scheduler already promised vLLM a hit, so the load must fail and vLLM must
recompute. Nothing else differs from ``LMCacheSvcConnector``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from lmcache_svc_vllm.connector import LMCacheSvcConnector

KILL_FILE_ENV = "LMCACHE_SVC_TEST_KILL_FILE"


class FaultInjectingConnector(LMCacheSvcConnector):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._plan().loads:
            _kill_requested_process()
        super().start_load_kv(forward_context, **kwargs)


def _kill_requested_process() -> None:
    path = Path(os.environ.get(KILL_FILE_ENV, "/nonexistent"))
    try:
        pid = int(path.read_text())
    except (OSError, ValueError):
        return
    path.unlink()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.01)
    path.with_suffix(".done").write_text(str(pid))


def _alive(pid: int) -> bool:
    """Running (not yet a zombie): its sockets may still answer."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")

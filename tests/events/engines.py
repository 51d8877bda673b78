"""What the end-to-end event tests share: a server publishing events, engines with the
plugin publishing theirs, and readers that decode streams with vLLM's own classes."""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcache_svc_bench.procs import ServerProc, free_port, start_server
from lmcache_svc_bench.vllm.engines import VLLM_PYTHON, EngineProc, kv_transfer_config

HERE = Path(__file__).resolve().parent


def events_env(**extra: str) -> dict[str, str]:
    """A server's environment: events on, loopback endpoints on free ports."""
    return {
        "LMCACHE_SVC_EVENTS__ENABLED": "true",
        "LMCACHE_SVC_EVENTS__ENDPOINT": "tcp://127.0.0.1:0",
        "LMCACHE_SVC_EVENTS__REPLAY_ENDPOINT": "tcp://127.0.0.1:0",
        "LMCACHE_SVC_EVENTS__NODE": "n1",
        **extra,
    }


def start_events_server(tmp: Path, *args: str, **env: str) -> ServerProc:
    return start_server(tmp, *args, env=events_env(**env))


def start_engine(
    name: str, model_dir: Path, tmp: Path, server: ServerProc, **extra: Any
) -> tuple[EngineProc, str]:
    """An engine with the plugin and vLLM's own event stream; returns it and the endpoint
    to read it at. vLLM binds a wildcard address (``tcp://*:port``; a literal address
    makes it connect instead); the readers use loopback."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    engine = EngineProc.start(
        name,
        model_dir,
        tmp,
        kv_config=kv_transfer_config(server.socket, retry_interval_s=0.2, **extra),
        kv_events_config={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "topic": f"engine-{name}",
        },
    )
    return engine, endpoint


@dataclass
class VllmReader:
    """``vllm_reader.py`` in vLLM's interpreter: every event of a stream, as dicts."""

    proc: subprocess.Popen[str]
    events: list[dict[str, Any]] = field(default_factory=list)
    _lines: queue.Queue[str] = field(default_factory=queue.Queue)

    @classmethod
    def start(cls, endpoint: str) -> VllmReader:
        proc = subprocess.Popen(
            [str(VLLM_PYTHON), str(HERE / "vllm_reader.py"), endpoint],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        reader = cls(proc)
        threading.Thread(target=reader._pump, daemon=True).start()
        reader.wait_for(lambda evs: any(e["type"] == "ready" for e in evs), 120)
        return reader

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def wait_for(
        self, check: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 60
    ) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while not check(self.events):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the stream never satisfied the check: {self.events[-20:]}")
            try:
                self.events.append(json.loads(self._lines.get(timeout=min(left, 0.5))))
            except queue.Empty:
                continue
        return self.events

    def drain(self) -> list[dict[str, Any]]:
        """Every event read so far."""
        while not self._lines.empty():
            self.events.append(json.loads(self._lines.get()))
        return self.events

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def of_type(events: list[dict[str, Any]], kind: str, medium: str | None = None) -> list[dict]:
    return [e for e in events if e["type"] == kind and (medium is None or e["medium"] == medium)]

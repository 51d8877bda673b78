"""A client's session: its end is seen, and an idle one costs the client nothing."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from lmcache_svc.client import CacheClient
from lmcache_svc.client.session import Session
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.helpers import make_namespace, wait_until

IDLE_S = 1.0


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[ServerProc]:
    proc = start_server(tmp_path)
    yield proc
    proc.cleanup()


def _open_session(client: CacheClient) -> Session:
    assert client.wait_shm_ready(30), "the segment was not mapped"
    session = client._live_session()
    assert session.alive
    return session


def test_a_session_ends_when_its_server_is_killed(server: ServerProc) -> None:
    with CacheClient(server.socket) as client:
        session = _open_session(client)
        os.kill(server.proc.pid, signal.SIGKILL)
        wait_until(lambda: not session.alive, 10, "the session's end")


def test_once_the_session_ends_no_lookup_reads_the_killed_server_s_index(
    server: ServerProc,
) -> None:
    """The index's tables of a killed server are not read for lookups: its lock is not
    asked for on a lookup (``IndexReader.lookup``), the session's end keeps them off."""
    namespace = make_namespace()
    hashes = [bytes([i]) * 32 for i in range(2)]
    with CacheClient(server.socket, local_lookup=True) as client:
        ns_id = client.register_namespace(namespace)
        assert client.store(ns_id, hashes, [bytes(namespace.chunk_bytes)] * 2) == 2
        session = _open_session(client)
        wait_until(lambda: client.lookup_local(ns_id, hashes) is not None, 10, "the index")
        assert client.lookup_local(ns_id, hashes).num_hit_chunks == 2  # type: ignore[union-attr]
        os.kill(server.proc.pid, signal.SIGKILL)
        wait_until(lambda: not session.alive, 10, "the session's end")
        assert client.lookup_local(ns_id, hashes) is None


def test_a_session_ends_when_its_server_stops(server: ServerProc) -> None:
    with CacheClient(server.socket) as client:
        session = _open_session(client)
        server.stop()
        wait_until(lambda: not session.alive, 10, "the session's end")


def test_an_idle_session_runs_no_python_code(server: ServerProc) -> None:
    """No thread of the client wakes to run Python while nothing is asked of it (a thread
    reading the session's stream did, ten times a second: gRPC's blocking read polls)."""
    calls: list[tuple[float, str]] = []

    def tracer(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            calls.append((time.monotonic(), f"{frame.f_code.co_filename}:{frame.f_code.co_name}"))

    threading.settrace(tracer)  # the threads started from now on (the main one is not)
    try:
        with CacheClient(server.socket) as client:
            session = _open_session(client)
            time.sleep(0.2)  # the set-up's own threads are done
            start = time.monotonic()
            time.sleep(IDLE_S)
            woke = [name for at, name in calls if at >= start]
            assert session.alive
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
    assert calls, "the tracer saw no thread at all: it cannot tell"
    assert woke == [], f"{len(woke)} calls while idle, first {woke[:5]}"

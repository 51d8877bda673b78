"""The client's connection attempts survive a server slow to answer the HTTP/2 handshake
(a loaded host, a server busy starting up)."""

from __future__ import annotations

import select
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_svc.client import CacheClient
from lmcache_svc_bench.procs import ServerProc, start_server

HANDSHAKE_DELAY_S = 1.5


def _pipe(a: socket.socket, b: socket.socket) -> None:
    try:
        while True:
            readable, _, _ = select.select([a, b], [], [], 30)
            if not readable:
                return
            for src in readable:
                data = src.recv(65536)
                if not data:
                    return
                (b if src is a else a).sendall(data)
    except OSError:
        return
    finally:
        a.close()
        b.close()


def _slow_proxy(listener: socket.socket, target: str) -> None:
    """Accept, wait ``HANDSHAKE_DELAY_S``, then relay bytes both ways to ``target``."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        time.sleep(HANDSHAKE_DELAY_S)
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(target)
        threading.Thread(target=_pipe, args=(conn, upstream), daemon=True).start()


@pytest.fixture
def slow_address(tmp_path: Path) -> Iterator[str]:
    server: ServerProc = start_server(tmp_path)
    workdir = Path(tempfile.mkdtemp(prefix="lmc-proxy-", dir="/tmp"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(workdir / "slow.sock"))
    listener.listen(8)
    threading.Thread(target=_slow_proxy, args=(listener, server.socket), daemon=True).start()
    yield f"unix:{workdir / 'slow.sock'}"
    listener.close()
    server.cleanup()
    shutil.rmtree(workdir, ignore_errors=True)


def test_a_slow_handshake_is_waited_for_within_the_call_deadline(slow_address: str) -> None:
    with CacheClient(slow_address, timeout_s=20, use_shm=False) as client:
        assert client.stats()["version"]
        assert client.list_memories() == []

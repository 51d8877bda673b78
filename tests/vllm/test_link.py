"""The plugin's server link against a real server that dies (SIGKILL) or hangs (SIGSTOP).

A down server must cost the engine one failed try per back-off period, the period doubling
while the outage lasts; a try that never reached the server must not count as the server
being back (which would reset the back-off and log "reachable again" once per retry). A
server restarted on the same Unix socket ends the back-off early: one try per new socket file.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from lmcache_svc_vllm.config import ConnectorConfig, Tuning
from lmcache_svc_vllm.link import Reservation, ServerLink
from lmcache_svc_vllm.socket_watch import RECONNECT_GRACE_S, SOCKET_CHECK_INTERVAL_S

from lmcache_svc.client import CacheClient
from lmcache_svc.client.events import ChunkTokens
from lmcache_svc.keys import KVLayout, Namespace, chunk_hashes
from lmcache_svc_bench.procs import start_server
from tests.events.test_store_paths import check_announced, events, prompt  # noqa: F401
from tests.helpers import ManualClock, count_calls, make_chunk, wait_until
from tests.server.inprocess import NS as INPROC_NS
from tests.server.inprocess import serve  # noqa: F401 (a fixture)

NAMESPACE = Namespace(
    model="link-test",
    layout=KVLayout("bfloat16", 2, 1, 32, 128, "vllm-cpu/BHNC"),
    chunk_size=256,
)
HASHES = chunk_hashes(NAMESPACE, list(range(2000, 2000 + 2 * 256)))
OUTAGE_S = 3.0
# Tries in OUTAGE_S with a 0.1 s deadline and a pause of 0.05 s doubling per failure:
# 0.15, 0.35, 0.65, 1.15, 2.05 s -> 5 (a pause that never grows: about 20 under SIGSTOP,
# hundreds under SIGKILL).
MAX_TRIES = 7


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_outage_backs_off_and_stays_on_shared_memory(
    tmp_path: Path,
    fault: Literal["kill", "stop"],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = start_server(tmp_path)
    config = ConnectorConfig(url=server.socket, rpc_timeout_ms=100, retry_interval_s=0.05)
    link = ServerLink(config, NAMESPACE, "link-test")
    try:
        healthy = _reserve_when_up(link)
        assert not healthy.inline and len(healthy.hashes) == 2
        link.publish(healthy, abort=True)

        tries = {
            name: count_calls(monkeypatch, link._client, name) for name in ("prepare_store", "put")
        }
        os.kill(server.proc.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        caplog.set_level(logging.INFO, logger="vllm.lmcache_svc_vllm.link")
        caplog.clear()
        deadline = time.monotonic() + OUTAGE_S
        while time.monotonic() < deadline:
            assert link.reserve(HASHES, NAMESPACE.chunk_bytes) is None
            time.sleep(0.005)

        assert 1 <= len(tries["prepare_store"]) <= MAX_TRIES, tries
        assert tries["put"] == [], "an outage turned shared-memory stores into inline puts"
        messages = [r.getMessage() for r in caplog.records]
        assert not [m for m in messages if "reachable again" in m], messages
        assert len([m for m in messages if "unavailable" in m]) == 1, messages
    finally:
        link.close()
        if server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.cleanup()


def test_register_tells_whether_the_server_answered(tmp_path: Path) -> None:
    """The plugin's event thread resyncs with a restarted server only once the namespace is
    registered there (else the server never publishes its topic): it must be able to tell
    a registration the server answered from one that failed."""
    server = start_server(tmp_path)
    config = ConnectorConfig(url=server.socket, rpc_timeout_ms=200, retry_interval_s=0.05)
    link = ServerLink(config, NAMESPACE, "register-test")
    try:
        assert link.register()[0]
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        answered, _ = link.register()
        assert not answered
    finally:
        link.close()
        server.cleanup()


def _reserve_when_up(link: ServerLink) -> Reservation:
    """The first calls (connect, map the segment) may outlast the short test deadline."""
    reservations: list[Reservation] = []

    def reserved() -> bool:
        reservation = link.reserve(HASHES, NAMESPACE.chunk_bytes)
        if reservation is not None:
            reservations.append(reservation)
        return reservation is not None

    wait_until(reserved, 20, "a reservation on the healthy server")
    return reservations[0]


def test_stores_after_the_first_take_slots_reserved_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first store reserves its slots (the pool is empty); once the server answered
    its commit the pool holds as many slots, and the next store copies into them without
    a prepare round trip; the pool's slots go back when the link closes."""
    server = start_server(tmp_path)
    pool = Tuning(store_pool_chunks=64)  # opt in: off by default
    config = ConnectorConfig(url=server.socket, tuning=pool)
    link = ServerLink(config, NAMESPACE, "link-test")
    try:
        first = _reserve_when_up(link)
        assert first.pooled == [] and len(first.hashes) == 2
        for buffer in first.buffers:
            buffer[:] = b"\x01" * len(buffer)
        assert link.publish(first) == 2
        pool = link._pool
        assert pool is not None
        wait_until(lambda: pool.num_slots >= 2, 20, "the pool refilled")

        prepares = count_calls(monkeypatch, link._client, "prepare_store")
        hashes = chunk_hashes(NAMESPACE, list(range(5000, 5000 + 2 * 256)))
        second = link.reserve(hashes, NAMESPACE.chunk_bytes)
        assert second is not None and len(second.pooled) == 2
        assert prepares == [], "a store waited for a reservation"
        payloads = [bytes([i + 7]) * len(b) for i, b in enumerate(second.buffers)]
        for buffer, data in zip(second.buffers, payloads):
            buffer[:] = data
        assert link.publish(second) == 2
        acquired = link.acquire(hashes)
        assert acquired is not None
        assert [bytes(b) for b in acquired.buffers] == payloads
        link.release(acquired)
    finally:
        link.close()
    try:
        with CacheClient(server.socket) as client:
            wait_until(
                lambda: client.stats()["pending_stores"] == 0, 20, "the link's pooled slots back"
            )
    finally:
        server.cleanup()


def test_inline_stores_carry_their_tokens_to_the_events(serve, events) -> None:  # noqa: F811
    """Without shared memory (another host, ``use_shm: false``) the plugin's stores are
    inline Puts: they carry the chunks' tokens, so they are announced like commits."""
    node, sub = events
    server = serve(num_chunks=4, listener=node)
    config = ConnectorConfig(url=server.socket, use_shm=False, chunk_size=INPROC_NS.chunk_size)
    link = ServerLink(config, INPROC_NS, "inline-events")
    try:
        answered, source = link.register()
        assert answered and source is not None  # the server publishes this namespace
        hashes, parents, tokens = prompt(5, 2)
        reservation = link.reserve(hashes, INPROC_NS.chunk_bytes)
        assert reservation is not None and reservation.inline
        described = ChunkTokens()
        for h, parent, part, buffer in zip(hashes, parents, tokens, reservation.buffers):
            buffer[:] = make_chunk(h.hex(), INPROC_NS.chunk_bytes)
            described.add(h, parent, np.asarray(part, "<u4").tobytes())
        assert link.publish(reservation, described=described) == 2
        check_announced(sub, hashes, tokens)
    finally:
        link.close()


LINK_LOGGER = "vllm.lmcache_svc_vllm.link"


def test_a_restarted_server_ends_the_back_off_early(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A server restarted on the same socket path binds a new socket file: the link tries it
    RECONNECT_GRACE_S after it sees the file, not after its back-off (600 s here: without
    the early try every lookup below would be a miss until the wait gave up)."""
    server = start_server(tmp_path)
    config = ConnectorConfig(
        url=server.socket, lookup_timeout_ms=5000, retry_interval_s=600, local_lookup=False
    )
    link = ServerLink(config, NAMESPACE, "restart-test")
    restarted = None
    try:
        wait_until(lambda: link.lookup(HASHES) is not None, 20, "a lookup on the first server")
        server.kill()  # SIGKILL: the socket file stays behind
        assert link.lookup(HASHES) is None and link.is_down
        caplog.set_level(logging.INFO, logger=LINK_LOGGER)
        restarted = start_server(tmp_path, socket_path=server.socket)
        wait_until(lambda: link.lookup(HASHES) is not None, 20, "a lookup on the new server")
        assert not link.is_down
        replaced = [r for r in caplog.records if "was replaced" in r.getMessage()]
        assert len(replaced) == 1 and replaced[0].levelno == logging.INFO, caplog.records
    finally:
        link.close()
        if restarted is not None:
            restarted.cleanup()
        server.cleanup()


def test_the_back_off_lasts_while_the_socket_file_is_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead server's socket file left behind, then removed: no new file, so the link keeps
    waiting and asks no server, however often it is called."""
    server = start_server(tmp_path)
    config = ConnectorConfig(url=server.socket, retry_interval_s=600, local_lookup=False)
    link = ServerLink(config, NAMESPACE, "same-socket-test")
    try:
        wait_until(lambda: link.lookup(HASHES) is not None, 20, "a lookup on the server")
        server.kill()
        assert link.lookup(HASHES) is None
        tries = count_calls(monkeypatch, link._client, "lookup")
        for left_behind in (True, False):
            if not left_behind:
                Path(server.socket).unlink()
            deadline = time.monotonic() + 3 * SOCKET_CHECK_INTERVAL_S
            while time.monotonic() < deadline:
                assert link.lookup(HASHES) is None and link.is_down, left_behind
                time.sleep(0.01)
        assert tries == []
    finally:
        link.close()
        server.cleanup()


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short directory for socket files (their paths are limited to 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="lmc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _refusing_socket(path: Path) -> socket.socket:
    """A socket file nobody listens on (connecting is refused); bound at a side name and
    renamed onto ``path``, so the file it replaces stays another inode while open."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    side = path.with_suffix(".new")
    sock.bind(str(side))
    os.replace(side, path)
    return sock


def test_a_new_socket_file_gets_one_try_then_the_back_off_doubles(
    socket_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Missing at the failure, then there: one try, RECONNECT_GRACE_S after the link saw
    the file (it looks once per SOCKET_CHECK_INTERVAL_S); that try is refused, so the
    back-off doubles and this file gets no other early try. Another new file: one more."""
    path = socket_dir / "grpc.sock"
    clock = ManualClock(1000.0)
    config = ConnectorConfig(url=str(path), retry_interval_s=5, local_lookup=False)
    link = ServerLink(config, NAMESPACE, "watch-test", clock=clock)
    tries = count_calls(monkeypatch, link._client, "register_namespace")
    caplog.set_level(logging.INFO, logger=LINK_LOGGER)
    sockets: list[socket.socket] = []
    grace_s = RECONNECT_GRACE_S
    try:

        def lookup_after(elapsed_s: float) -> int:
            clock.now += elapsed_s
            assert link.lookup(HASHES) is None
            return len(tries)

        assert lookup_after(0) == 1 and link.is_down  # no file: refused, wait 5 s
        assert lookup_after(0.3) == 1
        sockets.append(_refusing_socket(path))
        assert lookup_after(0.1) == 1  # looked 0.1 s ago: not yet
        assert lookup_after(0.2) == 1  # seen: the wait ends in grace_s
        assert lookup_after(grace_s - 0.01) == 1
        assert lookup_after(0.02) == 2  # tried, refused: wait 10 s
        assert [lookup_after(0.3) for _ in range(4)] == [2, 2, 2, 2]
        sockets.append(_refusing_socket(path))
        assert lookup_after(0.3) == 2  # another new file
        assert lookup_after(grace_s + 0.01) == 3  # refused: wait 20 s
        assert lookup_after(20 - 0.01) == 3
        assert lookup_after(0.02) == 4  # the back-off's own end
        replaced = [r for r in caplog.records if "was replaced" in r.getMessage()]
        assert len(replaced) == 2
    finally:
        link.close()
        for sock in sockets:
            sock.close()

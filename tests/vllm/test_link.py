"""The plugin's server link against a real server that dies (SIGKILL) or hangs (SIGSTOP).

A down server must cost the engine one failed try per back-off period, the period doubling
while the outage lasts; a try that never reached the server must not count as the server
being back (which would reset the back-off and log "reachable again" once per retry).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from lmcache_svc_vllm.config import ConnectorConfig, Tuning
from lmcache_svc_vllm.link import Reservation, ServerLink

from lmcache_svc.client import CacheClient
from lmcache_svc.client.events import ChunkTokens
from lmcache_svc.keys import KVLayout, Namespace, chunk_hashes
from lmcache_svc_bench.procs import start_server
from tests.events.test_store_paths import check_announced, events, prompt  # noqa: F401
from tests.helpers import count_calls, make_chunk, wait_until
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

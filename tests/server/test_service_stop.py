"""A server that stops lets what its gRPC calls left on the event loop end before it closes
the cache: a session whose client just went away is given back in full, not cut off; a
call that never ends is named in a warning, and the stop goes on."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from lmcache_svc.cache import TieredCache
from lmcache_svc.client import CacheClient
from lmcache_svc.server import app
from tests.helpers import in_process_config


def test_a_session_cleanup_running_at_stop_ends_before_the_cache_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    socket_path = tmp_path / "grpc.sock"
    config = in_process_config(
        socket=str(socket_path),
        # A tier that may block: the session clean-ups run off the event loop.
        **{"ssd.path": str(tmp_path / "ssd"), "ssd.capacity": "64MiB"},
    )
    cleanup_started = threading.Event()
    order: list[str] = []
    close_session = TieredCache.close_session
    close_cache = TieredCache.close

    def slow_close_session(self: TieredCache, session_id: str) -> None:
        cleanup_started.set()
        time.sleep(0.5)  # a clean-up still running when the server is told to stop
        close_session(self, session_id)
        order.append("session given back")

    def record_close(self: TieredCache) -> None:
        order.append("cache closed")
        close_cache(self)

    monkeypatch.setattr(TieredCache, "close_session", slow_close_session)
    monkeypatch.setattr(TieredCache, "close", record_close)

    def client_opens_and_leaves() -> None:
        with CacheClient(f"unix:{socket_path}", timeout_s=10) as client:
            assert client.shm_available  # opens the session stream
        assert cleanup_started.wait(10), "the server never saw the client go"

    async def scenario() -> None:
        service = app.Service(config)
        running = asyncio.create_task(service.run())
        while not socket_path.exists():
            assert not running.done(), running.exception()
            await asyncio.sleep(0.01)
        await asyncio.to_thread(client_opens_and_leaves)
        service.request_stop()
        await running

    asyncio.run(scenario())
    assert order == ["session given back", "cache closed"]


def test_a_call_still_running_after_the_wait_is_counted_in_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        callers = asyncio.all_tasks()
        stuck = asyncio.create_task(asyncio.Event().wait())  # a call that never ends
        await app._calls_end(callers, timeout_s=0.05)
        assert not stuck.done()  # the stop goes on: it does not hang on the call
        stuck.cancel()

    asyncio.run(scenario())
    assert "1 tasks of gRPC calls still running 0.05 s after the server stopped" in caplog.text

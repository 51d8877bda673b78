"""Fixtures that serve the REST app with uvicorn in a thread, on a real socket."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from lmcache_svc.cache import TieredCache
from lmcache_svc.server.http.api import create_app, make_uvicorn_server
from lmcache_svc.server.memories.store import MemoryStore
from tests.helpers import wait_until
from tests.server.rest import MAX_BODY_BYTES, App, Served, make_cache


@pytest.fixture
def serve_http() -> Iterator[Callable[..., Served]]:
    """Starts the app on ``cache`` (a fresh ``make_cache()`` unless given); other keywords go
    to ``create_app``, except ``limits`` (the server's connection limits). Stops them all."""
    stops: list[Callable[[], None]] = []

    def start(cache: TieredCache | None = None, **kwargs: Any) -> Served:
        cache = cache or make_cache()
        kwargs.setdefault("max_body_bytes", MAX_BODY_BYTES)
        limits = kwargs.pop("limits", None)
        server = make_uvicorn_server(create_app(cache, **kwargs), "127.0.0.1", 0, limits)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        wait_until(lambda: server.started or not thread.is_alive(), 10, "uvicorn started")
        assert server.started, "uvicorn's thread ended before it started"
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        client = httpx.Client(base_url=url, timeout=10)

        def stop() -> None:
            client.close()
            server.should_exit = True
            thread.join(timeout=10)
            cache.close()

        stops.append(stop)
        return Served(cache, url, client)

    yield start
    for stop in reversed(stops):
        stop()


@pytest.fixture
def serve_memories(serve_http: Callable[..., Served]) -> Callable[..., App]:
    """Starts the app with ``store`` (a small ``MemoryStore`` unless given) and 1 MiB bodies."""

    def start(store: MemoryStore | None = None, **kwargs: Any) -> App:
        store = store or MemoryStore(capacity_bytes=1 << 20, max_bytes=1 << 16)
        kwargs.setdefault("max_body_bytes", 1 << 20)
        return App(store, serve_http(memories=store, **kwargs).client)

    return start

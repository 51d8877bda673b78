"""A server that fails while starting gives its shared-memory arena back at once (not only at
the next start's orphan clean-up)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from lmcache_svc.errors import ConfigError
from lmcache_svc.server import app
from tests.helpers import in_process_config


def test_a_grpc_server_that_cannot_be_built_releases_the_arena(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = in_process_config(grpc_port=0)
    name = config.cpu.shm_name
    seen: list[bool] = []

    def fail(*args: object, **kwargs: object) -> None:
        seen.append(Path("/dev/shm", name).exists())  # the arena was made before this
        raise RuntimeError("grpc server could not be built")

    monkeypatch.setattr(app, "build_grpc_server", fail)
    with pytest.raises(RuntimeError, match="could not be built"):
        asyncio.run(app.Service(config).run())
    assert seen == [True]
    assert not Path("/dev/shm", name).exists()


def test_a_taken_grpc_port_releases_the_arena() -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        config = in_process_config(grpc_port=port)
        name = config.cpu.shm_name
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port} for gRPC"):
            asyncio.run(app.Service(config).run())
    finally:
        taken.close()
    assert not Path("/dev/shm", name).exists()

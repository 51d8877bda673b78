"""Load leases hand out read-only views of the shared segment: a reader's stray write raises
and never changes what later readers get."""

from __future__ import annotations

import pytest

from lmcache_svc.client import CacheClient
from tests.server.inprocess import CHUNK, NS, NS_ID
from tests.server.inprocess import serve as serve  # the fixture


def test_a_write_through_a_load_buffer_raises_and_changes_nothing(serve) -> None:
    srv = serve(4)
    data = bytes(range(256)) * (CHUNK // 256)
    with CacheClient(srv.socket) as client:
        assert client.shm_available and client.register_namespace(NS) == NS_ID
        assert client.store(NS_ID, [b"\x01" * 32], [data]) == 1
        lease = client.prepare_load(NS_ID, [b"\x01" * 32])
        (buffer,) = lease.buffers
        assert buffer.readonly
        with pytest.raises(TypeError):
            buffer[0] = 0xFF
        with pytest.raises(TypeError):
            buffer[:] = b"\xff" * CHUNK
        assert client.release_load(lease)
        with CacheClient(srv.socket) as later:
            assert later.load(NS_ID, [b"\x01" * 32]) == [data]

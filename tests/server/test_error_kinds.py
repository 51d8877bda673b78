"""Every exception kind crosses gRPC intact: the server's handler raises it, the client
raises the same class with the same message."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lmcache_svc import errors
from lmcache_svc.client import CacheClient
from tests.server.inprocess import InProcessServer
from tests.server.inprocess import serve as serve  # the fixture
from tests.test_wire import every_error_class


def test_every_error_kind_round_trips(serve: Callable[..., InProcessServer]) -> None:
    server = serve()
    raised: list[str] = []

    def failing_stats() -> None:
        raise current(f"{current.__name__} from the cache")

    server.cache.stats = failing_stats  # type: ignore[method-assign,assignment]
    with CacheClient(server.socket, timeout_s=30) as client:
        for current in every_error_class():
            with pytest.raises(errors.LMCacheSvcError) as caught:
                client.stats()
            assert type(caught.value) is current
            assert str(caught.value) == f"{current.__name__} from the cache"
            raised.append(current.__name__)
    assert len(raised) == len(every_error_class()) > 15

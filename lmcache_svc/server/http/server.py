"""The uvicorn server behind the REST app, with the connection limits uvicorn lacks.

uvicorn has no timeout for a request head: a client that opens a connection and sends half
a request line keeps it (and its buffers) forever. ``_HeadTimeout`` closes a connection that
has not completed a request head ``header_timeout_s`` after it opened or after its last
response. ``max_connections`` is the most connections served (uvicorn's
``limit_concurrency``; requests on connections beyond it get 503), ``keep_alive_s`` is
uvicorn's ``timeout_keep_alive``. Body timeouts live in ``http.edge``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    max_connections: int = 256


class _HeadTimeout:
    """Mixed into uvicorn's HTTP protocol: close a connection whose request head is late.

    A request has begun when the protocol made a new ``cycle``; the timer remembers the
    cycle it was armed under and closes the connection only if none began since and none is
    being served (httptools may start a pipelined cycle before the previous response ends).
    """

    header_timeout_s: float
    cycle: Any
    transport: asyncio.Transport
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        armed_under = self.cycle
        super().on_response_complete()  # type: ignore[misc]
        self._arm_head_timer(armed_under)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm_head_timer(self, armed_under: Any = None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        loop = asyncio.get_running_loop()
        cycle = self.cycle if armed_under is None else armed_under
        self._head_timer = loop.call_later(self.header_timeout_s, self._head_overdue, cycle)

    def _head_overdue(self, armed_under: Any) -> None:
        idle = self.cycle is None or self.cycle.response_complete  # not serving a request
        if self.cycle is armed_under and idle and not self.transport.is_closing():
            self.transport.close()


def _protocol_class(header_timeout_s: float) -> type[asyncio.Protocol]:
    return type(
        "LimitedHTTPProtocol",
        (_HeadTimeout, AutoHTTPProtocol),
        {"header_timeout_s": header_timeout_s},
    )


def make_uvicorn_config(app: Any, limits: ConnectionLimits, **kwargs: Any) -> uvicorn.Config:
    """uvicorn settings for ``app``: warnings only, no access log, ``limits`` applied."""
    return uvicorn.Config(
        app,
        http=_protocol_class(limits.header_timeout_s),
        # uvicorn refuses a request when len(connections) >= limit_concurrency, its own
        # connection included: + 1 makes max_connections the number served.
        limit_concurrency=limits.max_connections + 1,
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
        log_level="warning",
        access_log=False,
        **kwargs,
    )

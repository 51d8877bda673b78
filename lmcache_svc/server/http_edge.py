"""What wraps every REST request: authentication, the body limit, metrics, error bodies.

``Edge`` is a pure ASGI middleware (outside routing, so it also covers ``/docs``, ``/metrics``
and unknown paths). It checks the bearer token, refuses a declared ``Content-Length`` over
the limit before anything is read, cuts off a body that grows past the limit while it is
read (a missing or lying ``Content-Length`` gains nothing), counts and times each request
under its route name, and turns an unexpected exception into a logged, generic 500.

Every error leaves as ``{"error": kind, "message": str}`` (``error_response``), its status
chosen by ``server/status.py``; the kind is counted once, by ``Edge``, in ``errors``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.routing import Match, Router
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmcache_svc.errors import LMCacheSvcError, PayloadTooLarge, Unauthenticated
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.auth import check_bearer
from lmcache_svc.server.http_models import ErrorResponse
from lmcache_svc.server.status import INTERNAL_KIND, error_kind, http_status

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
"""Paths served without authentication."""
_ERROR_KIND_KEY = "lmcache_svc.error_kind"


def content_length(headers: Headers) -> int | None:
    value = headers.get("content-length")
    return int(value) if value is not None and value.isascii() and value.isdigit() else None


def error_response(
    scope: Scope, status: int, kind: str, message: str, detail: list[dict[str, Any]] | None = None
) -> JSONResponse:
    """The JSON error body; ``Edge`` counts ``kind`` in the errors metric."""
    scope[_ERROR_KIND_KEY] = kind
    body = ErrorResponse(error=kind, message=message, detail=detail)
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status)


# -- exception handlers (installed on the app by ``create_app``) ----------------------------


async def on_service_error(request: Request, exc: Exception) -> Response:
    return error_response(request.scope, http_status(exc), error_kind(exc), str(exc))


async def on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    detail = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
    message = "; ".join(".".join(map(str, d["loc"])) + f": {d['msg']}" for d in detail[:5])
    return error_response(request.scope, 422, "invalid_request", message, detail)


async def on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    response = error_response(request.scope, exc.status_code, kind, str(exc.detail))
    response.headers.update(exc.headers or {})
    return response


# -- the middleware -----------------------------------------------------------------------


class _Exchange:
    """One request as ``Edge`` sees it: the body limit on receive, the status on send."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, max_body_bytes: int) -> None:
        self.scope = scope
        self.headers = Headers(scope=scope)
        self.status = 500
        self.started = False
        self.too_large: PayloadTooLarge | None = None
        self._receive, self._send = receive, send
        self._max_body_bytes = max_body_bytes
        self._num_received = 0
        self._replaced = False

    def check_declared_length(self) -> None:
        declared = content_length(self.headers)
        if declared is not None and declared > self._max_body_bytes:
            raise PayloadTooLarge(
                f"body is {declared} bytes (Content-Length); this server "
                f"accepts at most {self._max_body_bytes} bytes"
            )

    async def receive(self) -> Message:
        """Pass the body through until it passes the limit, then act as if the client left."""
        if self.too_large is not None:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self._num_received += len(message.get("body", b""))
            if self._num_received > self._max_body_bytes:
                self.too_large = PayloadTooLarge(
                    f"body is over {self._max_body_bytes} bytes, this server's limit (stopped "
                    f"reading at {self._num_received} bytes)"
                )
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        """Forward the app's response, or replace it with 413 once the body went over."""
        if self.too_large is not None and not self.started:
            await self.respond(self.too_large)
            self._replaced = True
        if self._replaced:
            return
        if message["type"] == "http.response.start":
            self.started, self.status = True, message["status"]
        await self._send(message)

    async def respond(self, exc: Exception) -> None:
        if isinstance(exc, LMCacheSvcError):
            response = error_response(self.scope, http_status(exc), error_kind(exc), str(exc))
        else:
            response = error_response(
                self.scope, 500, INTERNAL_KIND, "internal server error; see the server log"
            )
        if isinstance(exc, Unauthenticated):
            response.headers["WWW-Authenticate"] = "Bearer"
        self.started, self.status = True, response.status_code
        await response(self.scope, self._receive, self._send)


class Edge:
    """ASGI middleware around every HTTP request: authentication, the body limit, request
    metrics (``lmcache_svc_requests``, ``_request_latency_seconds``, ``_errors``) and the
    last-resort 500 for unexpected exceptions."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        router: Router,
        metrics: Metrics,
        auth_token: str | None,
        max_body_bytes: int,
    ) -> None:
        self.app, self.router, self.metrics = app, router, metrics
        self.auth_token, self.max_body_bytes = auth_token, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(scope, receive, send, self.max_body_bytes)
        method = _route_name(self.router, scope)
        start = time.perf_counter()
        try:
            await self._serve(exchange, method)
        finally:
            self.metrics.request_latency.labels("http", method).observe(time.perf_counter() - start)
            self.metrics.requests.labels("http", method, str(exchange.status)).inc()
            if (kind := scope.get(_ERROR_KIND_KEY)) is not None:
                self.metrics.errors.labels(kind=kind).inc()

    async def _serve(self, exchange: _Exchange, method: str) -> None:
        try:
            if exchange.scope["path"] not in OPEN_PATHS:
                check_bearer(exchange.headers.get("authorization"), self.auth_token)
            exchange.check_declared_length()
        except LMCacheSvcError as e:
            await exchange.respond(e)
            return
        try:
            await self.app(exchange.scope, exchange.receive, exchange.send)
        except Exception as e:
            if exchange.too_large is not None:  # the app choked on the cut-off body
                if not exchange.started:
                    await exchange.respond(exchange.too_large)
                return
            log.exception("unexpected error in HTTP handler %s", method)
            if exchange.started:
                raise
            await exchange.respond(e)


def _route_name(router: Router, scope: Scope) -> str:
    """The matched route's name (``put_chunk``), for metric labels; ``unmatched`` if none."""
    partial = "unmatched"
    for route in router.routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return getattr(route, "name", partial)
        if match is Match.PARTIAL and partial == "unmatched":
            partial = getattr(route, "name", partial)
    return partial

"""What wraps every REST request: authentication, body limits, metrics, error bodies.

``Edge`` is a pure ASGI middleware (outside routing, so it also covers ``/docs``, ``/metrics``
and unknown paths). It authenticates the bearer token into a ``Principal`` (kept in the
scope for the handlers' tenant checks; ``principal``) and applies the route's policy (admin
only, writes refused to read-only tokens). It refuses a declared ``Content-Length`` over the
route's limit (``max_body_bytes`` for chunk bodies, ``max_json_bytes`` for everything else)
before anything is read, cuts off a body that grows past it while it is read (a missing or
lying ``Content-Length`` gains nothing), answers 408 and closes the connection when a body
makes no progress for ``body_idle_timeout_s``, counts and times each request under its route
name, and turns an unexpected exception into a logged, generic 500.

Every error leaves as ``{"error": kind, "message": str}`` (``error_response``), its status
chosen by ``server/status.py``; the kind is counted once, by ``Edge``, in ``errors``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match, Router
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmcache_svc.errors import (
    BodyTimeout,
    InvalidArgument,
    LMCacheSvcError,
    PayloadTooLarge,
    Unauthenticated,
)
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.auth import OPEN, Principal
from lmcache_svc.server.http.models import ErrorResponse
from lmcache_svc.server.status import INTERNAL_KIND, error_kind, http_status
from lmcache_svc.server.tokens import Authenticator

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
"""Paths served without authentication."""
_ERROR_KIND_KEY = "lmcache_svc.error_kind"
_PRINCIPAL_KEY = "lmcache_svc.principal"


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """Route names (``http/api.py``'s endpoint names) with rules beyond "any valid token"."""

    admin: frozenset[str]
    """Need an admin token."""
    write: frozenset[str]
    """Refused to read-only tokens."""
    chunk_body: frozenset[str]
    """Take a chunk body (limit ``max_body_bytes``); every other body is JSON."""


@dataclass(frozen=True, slots=True)
class Limits:
    max_body_bytes: int
    max_json_bytes: int
    body_idle_timeout_s: float | None = None


def principal(scope: Scope) -> Principal:
    """Who sent this request (set by ``Edge``; everyone is admin when auth is off)."""
    found: Principal = scope.get(_PRINCIPAL_KEY, OPEN)
    return found


def content_length(headers: Headers) -> int | None:
    value = headers.get("content-length")
    return int(value) if value is not None and value.isascii() and value.isdigit() else None


async def read_body(
    request: Request, limit: int, too_long: Callable[[str], LMCacheSvcError]
) -> bytearray:
    """The whole request body, refused with ``too_long(what was read)`` as soon as it
    exceeds ``limit`` bytes; a client gone mid-body is an ``InvalidArgument``."""
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise too_long(f"at least {len(body)} bytes")
    except ClientDisconnect:
        raise InvalidArgument("the client went away before sending the whole body") from None
    return body


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

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope = scope
        self.headers = Headers(scope=scope)
        self.status = 500
        self.started = False
        self.too_large: PayloadTooLarge | None = None
        self.stalled: BodyTimeout | None = None
        self._receive, self._send = receive, send
        self._max_body_bytes = 0
        self._what = "body"
        self._idle_timeout_s: float | None = None
        self._num_received = 0
        self._body_done = False
        self._replaced = False

    def limit_body(self, max_bytes: int, what: str, idle_timeout_s: float | None) -> None:
        self._max_body_bytes, self._what, self._idle_timeout_s = max_bytes, what, idle_timeout_s

    def check_declared_length(self) -> None:
        declared = content_length(self.headers)
        if declared is not None and declared > self._max_body_bytes:
            raise PayloadTooLarge(
                f"{self._what} is {declared} bytes (Content-Length); this server "
                f"accepts at most {self._max_body_bytes} bytes"
            )

    @property
    def refusal(self) -> LMCacheSvcError | None:
        return self.too_large or self.stalled

    async def receive(self) -> Message:
        """Pass the body through until it passes the limit or stalls, then act as if the
        client left (the app stops reading; ``send`` answers 413 or 408 instead)."""
        if self.refusal is not None:
            return {"type": "http.disconnect"}
        timeout_s = None if self._body_done else self._idle_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                message = await self._receive()
        except TimeoutError:
            self.stalled = BodyTimeout(
                f"the request body made no progress for {self._idle_timeout_s:g} s "
                f"(received {self._num_received} bytes)"
            )
            return {"type": "http.disconnect"}
        if message["type"] == "http.request":
            self._body_done = not message.get("more_body", False)
            self._num_received += len(message.get("body", b""))
            if self._num_received > self._max_body_bytes:
                self.too_large = PayloadTooLarge(
                    f"{self._what} is over {self._max_body_bytes} bytes, this server's limit "
                    f"(stopped reading at {self._num_received} bytes)"
                )
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        """Forward the app's response, or replace it with 413/408 once the body was cut."""
        if (refusal := self.refusal) is not None and not self.started:
            await self.respond(refusal)
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
        if exc is self.refusal:  # a body cut off unread: close rather than drain the rest
            response.headers["Connection"] = "close"
        self.started, self.status = True, response.status_code
        await response(self.scope, self._receive, self._send)


class Edge:
    """ASGI middleware around every HTTP request: authentication and route policy, body
    limits and the body idle timeout, request metrics (``lmcache_svc_requests``,
    ``_request_latency_seconds``, ``_errors``) and the last-resort 500."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        router: Router,
        metrics: Metrics,
        auth: Authenticator | None,
        policy: RoutePolicy,
        limits: Limits,
    ) -> None:
        self.app, self.router, self.metrics = app, router, metrics
        self.auth, self.policy, self.limits = auth, policy, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(scope, receive, send)
        method = _route_name(self.router, scope)
        lim = self.limits
        if method in self.policy.chunk_body:
            exchange.limit_body(lim.max_body_bytes, "body", lim.body_idle_timeout_s)
        else:
            json_limit = min(lim.max_json_bytes, lim.max_body_bytes)
            exchange.limit_body(json_limit, "JSON body", lim.body_idle_timeout_s)
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
                self._authorize(exchange, method)
            exchange.check_declared_length()
        except LMCacheSvcError as e:
            await exchange.respond(e)
            return
        try:
            await self.app(exchange.scope, exchange.receive, exchange.send)
        except Exception as e:
            if (refusal := exchange.refusal) is not None:  # the app choked on the cut body
                if not exchange.started:
                    await exchange.respond(refusal)
                return
            log.exception("unexpected error in HTTP handler %s", method)
            if exchange.started:
                raise
            await exchange.respond(e)

    def _authorize(self, exchange: _Exchange, method: str) -> None:
        if self.auth is None:
            return
        who = self.auth.authenticate(exchange.headers.get("authorization"))
        exchange.scope[_PRINCIPAL_KEY] = who
        if method in self.policy.admin:
            who.check_admin(f"{exchange.scope['method']} {exchange.scope['path']}")
        if method in self.policy.write:
            who.check_write(f"{exchange.scope['method']} {exchange.scope['path']}")


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

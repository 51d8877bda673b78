"""REST resource limits on real sockets: JSON body cap, parsing off the event loop, request
head and body timeouts, the connection limit."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

from lmcache_svc.server.http.api import DEFAULT_MAX_JSON_BYTES
from lmcache_svc.server.http.models import KeysRequest
from lmcache_svc.server.http.server import ConnectionLimits
from tests.helpers import CHUNK_BYTES, make_chunk, make_namespace, wait_until
from tests.server.rest import Served
from tests.server.test_http import _connect, _read_response, assert_error

BIG_BODY_LIMIT = 64 << 20  # chunk bodies may be this large; JSON bodies may not


def _closed_by_server(sock: socket.socket, timeout_s: float = 30) -> bytes:
    """Everything the server sends until it closes; fails if it keeps the socket open."""
    sock.settimeout(timeout_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


# -- JSON bodies ------------------------------------------------------------------------------


def _keys_body(ns_hex: str, num_tokens: int) -> bytes:
    return json.dumps({"namespace_id": ns_hex, "token_ids": [123456] * num_tokens}).encode()


def test_json_body_over_the_json_limit_is_413_before_parsing(
    serve_http: Callable[..., Served],
) -> None:
    served = serve_http(max_body_bytes=BIG_BODY_LIMIT)  # JSON keeps its own, smaller default
    ns_hex = served.register(make_namespace())
    body = _keys_body(ns_hex, DEFAULT_MAX_JSON_BYTES // 8 + 1000)  # just over 4 MiB
    assert DEFAULT_MAX_JSON_BYTES < len(body) < BIG_BODY_LIMIT
    r = served.client.post("/v1/keys", content=body, headers={"Content-Type": "application/json"})
    assert_error(r, 413, "payload_too_large", "JSON body", str(DEFAULT_MAX_JSON_BYTES))
    pieces = [body[i : i + 65536] for i in range(0, len(body), 65536)]
    r = served.client.post("/v1/lookup", content=iter(pieces))  # no Content-Length
    assert_error(r, 413, "payload_too_large", "stopped reading", str(DEFAULT_MAX_JSON_BYTES))
    assert r.headers["connection"] == "close"  # the rest is not drained
    for path in ("/v1/namespaces", "/v1/keys", "/v1/lookup"):
        r = served.client.post(path, content=b" " * (DEFAULT_MAX_JSON_BYTES + 1))
        assert_error(r, 413, "payload_too_large", "JSON body")
    # a chunk body is still allowed up to max_body_bytes
    ns_hex_url = f"/v1/chunks/{ns_hex}/{'ab' * 32}"
    assert served.client.put(ns_hex_url, content=make_chunk(1)).status_code == 201


def test_json_limit_is_configurable(serve_http: Callable[..., Served]) -> None:
    served = serve_http(max_body_bytes=BIG_BODY_LIMIT, max_json_bytes=1024)
    ns_hex = served.register(make_namespace())
    assert served.client.post("/v1/keys", content=_keys_body(ns_hex, 10)).status_code == 200
    r = served.client.post("/v1/keys", content=_keys_body(ns_hex, 200))
    assert_error(r, 413, "payload_too_large", "1024")


def test_json_bodies_are_parsed_off_the_event_loop(
    serve_http: Callable[..., Served],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    served = serve_http(max_body_bytes=BIG_BODY_LIMIT)
    ns_hex = served.register(make_namespace())
    on_loop: list[bool] = []
    original = KeysRequest.model_validate_json

    def spy(data: Any, **kwargs: Any) -> KeysRequest:
        on_loop.append(_in_event_loop())
        return original(data, **kwargs)

    monkeypatch.setattr(KeysRequest, "model_validate_json", spy)
    r = served.client.post("/v1/keys", content=_keys_body(ns_hex, 128))
    assert r.status_code == 200 and len(r.json()["chunk_hashes"]) == 8
    assert on_loop == [False], "the body was parsed on the event loop"


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


# -- timeouts ---------------------------------------------------------------------------------


def test_half_sent_request_head_is_closed_after_the_header_timeout(
    serve_http: Callable[..., Served],
) -> None:
    served = serve_http(limits=ConnectionLimits(header_timeout_s=0.5))
    silent = _connect(served.url)  # sends nothing at all
    half = _connect(served.url)
    half.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never finishes
    assert _closed_by_server(silent) == b""
    assert _closed_by_server(half) == b""
    # after a response the timer runs again: a keep-alive connection cannot half-send either
    sock = _connect(served.url)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b" 200 " in _read_response(sock).split(b"\r\n")[0]
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    assert _closed_by_server(sock) == b""
    assert served.client.get("/healthz").status_code == 200


def test_head_timeout_does_not_cut_a_slow_body(serve_http: Callable[..., Served]) -> None:
    served = serve_http(limits=ConnectionLimits(header_timeout_s=0.2), body_idle_timeout_s=30)
    ns_hex = served.register(make_namespace())
    sock = _connect(served.url)
    sock.sendall(
        f"PUT /v1/chunks/{ns_hex}/{'cd' * 32} HTTP/1.1\r\nHost: x\r\n"
        f"Content-Length: {CHUNK_BYTES}\r\n\r\n".encode()
    )
    data = make_chunk(5)
    for i in range(0, CHUNK_BYTES, CHUNK_BYTES // 4):  # the body takes longer than the head
        time.sleep(0.15)  # timeout, and each piece comes well within the body idle timeout
        sock.sendall(data[i : i + CHUNK_BYTES // 4])
    assert b" 201 " in _read_response(sock).split(b"\r\n")[0]


@pytest.mark.parametrize("what", ["chunk", "json"])
def test_stalled_body_gets_408_and_the_connection_closes(
    serve_http: Callable[..., Served],
    what: str,
) -> None:
    served = serve_http(body_idle_timeout_s=0.5)
    ns_hex = served.register(make_namespace())
    if what == "chunk":
        head = f"PUT /v1/chunks/{ns_hex}/{'ef' * 32} HTTP/1.1\r\n"
        length, sent = CHUNK_BYTES, make_chunk(3)[: CHUNK_BYTES // 2]
    else:
        head = "POST /v1/lookup HTTP/1.1\r\nContent-Type: application/json\r\n"
        length, sent = 1000, b'{"namespace_id": "' + ns_hex.encode()
    sock = _connect(served.url)
    sock.sendall(f"{head}Host: x\r\nContent-Length: {length}\r\n\r\n".encode() + sent)
    response = _closed_by_server(sock)
    status, _, rest = response.partition(b"\r\n")
    assert b" 408 " in status, response
    assert b"request_timeout" in rest and b"no progress" in rest
    assert served.client.head(f"/v1/chunks/{ns_hex}/{'ef' * 32}").status_code == 404
    assert served.cache.stats().pending_stores == 0


# -- connection limit -------------------------------------------------------------------------


def test_connection_limit_answers_503_beyond_it(serve_http: Callable[..., Served]) -> None:
    served = serve_http(limits=ConnectionLimits(header_timeout_s=60, max_connections=3))
    held = [_connect(served.url) for _ in range(2)]
    for sock in held:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # half-sent, held open
    third = _connect(served.url)
    third.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b" 200 " in _read_response(third).split(b"\r\n")[0]  # 3 connections: served
    held.append(_connect(served.url))
    held[-1].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    fifth = _connect(served.url)
    fifth.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b" 503 " in _closed_by_server(fifth).split(b"\r\n")[0]  # 5 > 3: refused
    for sock in held:
        sock.close()
    third.close()
    wait_until(  # the server saw them close
        lambda: served.client.get("/healthz").status_code == 200, 30, "the connections' slots back"
    )

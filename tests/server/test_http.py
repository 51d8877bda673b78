"""The REST transport on a real socket: uvicorn in a thread, driven by httpx, sockets and curl."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest

from lmcache_svc.errors import (
    ConfigError,
    Corrupted,
    InvalidArgument,
    NoSpace,
    NotFound,
    PayloadTooLarge,
    ServerUnavailable,
    SizeMismatch,
    TierError,
    Unauthenticated,
    UnknownNamespace,
)
from lmcache_svc.keys import chunk_hashes
from lmcache_svc.server.auth import check_bearer
from lmcache_svc.server.http.api import create_app
from lmcache_svc.server.status import grpc_code, http_status
from tests.helpers import CHUNK_BYTES, make_chunk, make_layout, make_namespace
from tests.server.rest import MAX_BODY_BYTES, MAX_CHUNKS, Served, make_cache

CHUNK_SIZE = 16  # tokens per chunk of make_namespace()
TOKEN = "s3cret-token"


@pytest.fixture
def served(serve_http: Callable[..., Served]) -> Served:
    return serve_http()


def assert_error(r: httpx.Response, status: int, kind: str, *fragments: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"] == kind, body
    for fragment in fragments:
        assert fragment in body["message"], body


def metric_value(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


# -- happy paths ------------------------------------------------------------------------------


def test_chunk_round_trip(served: Served) -> None:
    ns = make_namespace()
    c = served.client
    r = c.post("/v1/namespaces", json=ns.to_dict())
    assert r.status_code == 200
    assert r.json() == {"namespace_id": ns.namespace_id.hex(), "chunk_bytes": CHUNK_BYTES}
    ns_hex = ns.namespace_id.hex()
    r = c.post("/v1/keys", json={"namespace_id": ns_hex, "token_ids": list(range(40))})
    assert r.status_code == 200
    h0, h1 = r.json()["chunk_hashes"]
    url = served.chunk_url(ns_hex, h0)
    data = make_chunk(1)

    r = c.put(url, content=data, headers={"Content-Type": "application/octet-stream"})
    assert (r.status_code, r.json()) == (201, {"status": "stored"})
    r = c.put(url, content=data)
    assert (r.status_code, r.json()) == (200, {"status": "already_stored"})

    r = c.head(url)
    assert r.status_code == 200
    assert r.headers["content-length"] == str(CHUNK_BYTES)
    assert r.headers["x-lmcache-tier"] == "cpu"
    r = c.get(url)
    assert r.status_code == 200
    assert r.content == data
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.headers["x-lmcache-tier"] == "cpu"

    r = c.post("/v1/lookup", json={"namespace_id": ns_hex, "chunk_hashes": [h0, h1]})
    assert r.json() == {"num_hit_chunks": 1, "tiers": ["cpu"]}
    stats = c.get("/v1/stats").json()
    assert stats["num_namespaces"] == 1
    assert stats["tiers"][0]["name"] == "cpu" and stats["tiers"][0]["num_chunks"] == 1
    assert stats["active_leases"] == 0 and stats["pending_stores"] == 0

    assert c.delete(url).status_code == 204
    assert_error(c.get(url), 404, "not_found", h0)
    assert c.head(url).status_code == 404
    assert_error(c.delete(url), 404, "not_found")
    r = c.post("/v1/lookup", json={"namespace_id": ns_hex, "chunk_hashes": [h0, h1]})
    assert r.json() == {"num_hit_chunks": 0, "tiers": []}


def test_keys_agree_with_keys_module(served: Served) -> None:
    ns = make_namespace()
    ns_hex = served.register(ns)
    tokens = [(i * 7919) % 50000 for i in range(50)]
    for include_partial in (False, True):
        expected = [h.hex() for h in chunk_hashes(ns, tokens, include_partial=include_partial)]
        by_id = {"namespace_id": ns_hex, "token_ids": tokens, "include_partial": include_partial}
        inline = {
            "namespace": ns.to_dict(),
            "token_ids": tokens,
            "include_partial": include_partial,
        }
        for body in (by_id, inline):
            r = served.client.post("/v1/keys", json=body)
            assert r.status_code == 200, r.text
            assert r.json() == {
                "namespace_id": ns_hex,
                "chunk_size": CHUNK_SIZE,
                "chunk_hashes": expected,
            }
    assert len(expected) == 4  # 3 full chunks and the partial one


def test_inline_namespace_in_keys_is_not_registered(served: Served) -> None:
    ns = make_namespace(model="never-registered")
    r = served.client.post("/v1/keys", json={"namespace": ns.to_dict(), "token_ids": [1] * 16})
    assert r.status_code == 200
    assert served.client.get("/v1/stats").json()["num_namespaces"] == 0


def test_put_with_chunked_transfer_encoding(served: Served) -> None:
    ns_hex = served.register(make_namespace())
    data = make_chunk(2)
    url = served.chunk_url(ns_hex, "ab" * 32)
    r = served.client.put(url, content=iter([data[:1000], data[1000:]]))  # no Content-Length
    assert r.status_code == 201, r.text
    assert served.client.get(url).content == data


# -- bad input ----------------------------------------------------------------------------------


def test_bad_paths(served: Served) -> None:
    ns_hex = served.register(make_namespace())
    good_hash = "00" * 32
    c = served.client
    for method in ("GET", "HEAD", "DELETE", "PUT"):
        content = make_chunk(0) if method == "PUT" else None
        r = c.request(method, f"/v1/chunks/xyz/{good_hash}", content=content)
        assert r.status_code == 400, (method, r.text)
        r = c.request(method, f"/v1/chunks/{ns_hex}/{'zz' * 32}", content=content)
        assert r.status_code == 400, (method, r.text)
    assert_error(
        c.get(f"/v1/chunks/xyz/{good_hash}"), 400, "invalid_argument", "namespace id", "32 hex"
    )
    assert_error(
        c.get(f"/v1/chunks/{ns_hex}/{'ab' * 31}"), 400, "invalid_argument", "chunk hash", "64 hex"
    )
    unknown = make_namespace(model="unknown").namespace_id.hex()
    assert_error(
        c.put(served.chunk_url(unknown, good_hash), content=make_chunk(0)),
        404,
        "unknown_namespace",
        unknown,
    )
    assert_error(c.get(served.chunk_url(unknown, good_hash)), 404, "unknown_namespace")
    assert_error(c.get("/v1/nothing-here"), 404, "not_found")
    assert_error(c.post("/v1/stats"), 405, "method_not_allowed")


def test_wrong_body_size(served: Served) -> None:
    ns_hex = served.register(make_namespace())
    url = served.chunk_url(served.register(make_namespace()), "cd" * 32)
    assert ns_hex in url
    for size in (0, 100, CHUNK_BYTES - 1, CHUNK_BYTES + 1, 3 * CHUNK_BYTES):
        r = served.client.put(url, content=b"x" * size)
        assert_error(r, 400, "size_mismatch", f"{size} bytes", f"exactly {CHUNK_BYTES} bytes")
    r = served.client.put(url, content=iter([b"x" * (3 * CHUNK_BYTES)]))  # chunked, too long
    assert_error(r, 400, "size_mismatch", "at least", str(CHUNK_BYTES))
    r = served.client.put(url, content=iter([b"x" * 10]))  # chunked, too short
    assert_error(r, 400, "size_mismatch", "10 bytes")
    assert served.client.head(url).status_code == 404


def test_bad_json_bodies(served: Served) -> None:
    ns = make_namespace()
    ns_hex = served.register(ns)
    c = served.client
    bad_dtype = ns.to_dict() | {"layout": ns.to_dict()["layout"] | {"dtype": "float13"}}
    assert_error(c.post("/v1/namespaces", json=bad_dtype), 400, "invalid_argument", "float13")
    assert_error(
        c.post("/v1/namespaces", json=ns.to_dict() | {"tp_rank": 3}),
        400,
        "invalid_argument",
        "tp_rank",
    )
    assert_error(
        c.post("/v1/namespaces", json=ns.to_dict() | {"key_version": 9}),
        400,
        "invalid_argument",
        "key_version",
    )
    no_model = {k: v for k, v in ns.to_dict().items() if k != "model"}
    assert_error(c.post("/v1/namespaces", json=no_model), 422, "invalid_request", "model")
    assert_error(
        c.post("/v1/namespaces", json=ns.to_dict() | {"extra": 1}), 422, "invalid_request", "extra"
    )
    r = c.post("/v1/namespaces", content=b"{not json", headers={"Content-Type": "application/json"})
    assert_error(r, 422, "invalid_request")
    both = {"namespace": ns.to_dict(), "namespace_id": ns_hex, "token_ids": [1]}
    assert_error(c.post("/v1/keys", json=both), 400, "invalid_argument", "exactly one")
    assert_error(c.post("/v1/keys", json={"token_ids": [1]}), 400, "invalid_argument")
    assert_error(
        c.post("/v1/keys", json={"namespace_id": "12", "token_ids": [1]}),
        400,
        "invalid_argument",
        "namespace id",
    )
    r = c.post("/v1/keys", json={"namespace_id": ns_hex, "token_ids": [1, -1]})
    assert_error(r, 422, "invalid_request", "token_ids.1")
    r = c.post("/v1/keys", json={"namespace_id": ns_hex, "token_ids": [2**32]})
    assert_error(r, 422, "invalid_request")
    r = c.post("/v1/lookup", json={"namespace_id": ns_hex, "chunk_hashes": ["00" * 32, "0x"]})
    assert_error(r, 400, "invalid_argument", "chunk_hashes[1]")
    r = c.post("/v1/lookup", json={"namespace_id": "00" * 16, "chunk_hashes": []})
    assert_error(r, 404, "unknown_namespace")


def test_too_many_hashes_and_tokens(served: Served) -> None:
    ns_hex = served.register(make_namespace())
    hashes = [f"{i:064x}" for i in range(MAX_CHUNKS + 1)]
    r = served.client.post("/v1/lookup", json={"namespace_id": ns_hex, "chunk_hashes": hashes})
    assert_error(r, 413, "payload_too_large", f"{MAX_CHUNKS + 1} chunks", str(MAX_CHUNKS))
    r = served.client.post("/v1/lookup", json={"namespace_id": ns_hex, "chunk_hashes": hashes[1:]})
    assert r.status_code == 200
    tokens = [1] * (MAX_CHUNKS * CHUNK_SIZE + 1)
    r = served.client.post("/v1/keys", json={"namespace_id": ns_hex, "token_ids": tokens})
    assert_error(r, 413, "payload_too_large", str(MAX_CHUNKS * CHUNK_SIZE))


def test_body_over_limit_with_honest_content_length(served: Served) -> None:
    big = make_namespace(model="big", layout=make_layout(head_size=32 * 128))  # 128 KiB chunks
    big_hex = served.register(big)
    url = served.chunk_url(big_hex, "ee" * 32)
    r = served.client.put(url, content=b"x" * big.chunk_bytes)
    assert_error(r, 413, "payload_too_large", str(big.chunk_bytes), str(MAX_BODY_BYTES))
    r = served.client.put(url, content=iter([b"x" * 100]))  # no Content-Length: still refused
    assert_error(r, 413, "payload_too_large", str(big.chunk_bytes), str(MAX_BODY_BYTES))
    ns_hex = served.register(make_namespace())
    body = {"namespace_id": ns_hex, "chunk_hashes": ["00" * 32] * 2000}  # about 130 KB
    r = served.client.post("/v1/lookup", json=body)
    assert_error(r, 413, "payload_too_large", str(MAX_BODY_BYTES), "Content-Length")


def test_body_over_limit_without_content_length(served: Served) -> None:
    ns_hex = served.register(make_namespace())
    pieces = (
        [b'{"namespace_id": "' + ns_hex.encode() + b'", "chunk_hashes": [']
        + [b'"' + b"00" * 32 + b'", ' for _ in range(4000)]
        + [b'"' + b"00" * 32 + b'"]}']
    )
    r = served.client.post(
        "/v1/lookup", content=iter(pieces), headers={"Content-Type": "application/json"}
    )
    assert_error(r, 413, "payload_too_large", "stopped reading", str(MAX_BODY_BYTES))
    assert served.client.get("/healthz").status_code == 200


def _read_response(sock: socket.socket) -> bytes:
    """One HTTP response (headers and a Content-Length body) from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    match = re.search(rb"(?i)content-length: (\d+)", head)
    assert match is not None, head
    length = int(match.group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_lying_content_length_cannot_push_more_than_declared(served: Served) -> None:
    ns_hex = served.register(make_namespace())
    path = served.chunk_url(ns_hex, "12" * 32)
    data = make_chunk(3)
    # The header says one chunk; the client sends one chunk and then 256 KiB more. The
    # server answers after exactly the declared bytes; the rest is not this request's body.
    with _connect(served.url) as sock:
        sock.sendall(
            f"PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {CHUNK_BYTES}\r\n\r\n".encode()
            + data
        )
        assert _read_response(sock).startswith(b"HTTP/1.1 201 ")
        with contextlib.suppress(OSError):  # the server drops the connection on the garbage
            sock.sendall(b"\xff" * (256 * 1024))
            reply = sock.recv(65536)
            assert not reply or reply.startswith(b"HTTP/1.1 400 "), reply[:100]
    assert served.client.get(path).content == data
    # The header says 100 bytes, for a namespace of 4096-byte chunks: refused before reading.
    path2 = served.chunk_url(ns_hex, "34" * 32)
    with _connect(served.url) as sock:
        sock.sendall(f"PUT {path2} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n".encode())
        reply = _read_response(sock)
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:200]
    assert b"100 bytes" in reply and str(CHUNK_BYTES).encode() in reply
    # The header says more than the limit: refused before reading.
    with _connect(served.url) as sock:
        sock.sendall(
            f"PUT {path2} HTTP/1.1\r\nHost: x\r\nContent-Length: {1 << 40}\r\n\r\n".encode()
        )
        reply = _read_response(sock)
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    assert served.client.head(path2).status_code == 404
    assert served.client.get("/healthz").status_code == 200


def test_no_space_when_arena_full_of_pinned_chunks(serve_http: Callable[..., Served]) -> None:
    served = serve_http(make_cache(capacity_bytes=4 * CHUNK_BYTES))  # room for exactly 4 chunks
    ns = make_namespace()
    ns_hex = served.register(ns)
    hashes = chunk_hashes(ns, list(range(5 * CHUNK_SIZE)))
    for i, h in enumerate(hashes[:4]):
        r = served.client.put(served.chunk_url(ns_hex, h), content=make_chunk(i))
        assert r.status_code == 201
    lease = served.cache.prepare_load(ns.namespace_id, hashes[:4])
    assert lease.lease_id is not None and len(lease.slots) == 4
    r = served.client.put(served.chunk_url(ns_hex, hashes[4]), content=make_chunk(4))
    assert_error(r, 507, "no_space", "pinned")
    served.cache.release_load(lease.lease_id)
    r = served.client.put(served.chunk_url(ns_hex, hashes[4]), content=make_chunk(4))
    assert r.status_code == 201  # the least recently used chunk was evicted


def test_conflict_while_another_client_stores(served: Served) -> None:
    ns = make_namespace()
    ns_hex = served.register(ns)
    h = bytes(range(32))
    (prepared,) = served.cache.prepare_store(ns.namespace_id, [h], session_id="other")
    assert prepared.status == "reserved"
    assert_error(
        served.client.put(served.chunk_url(ns_hex, h), content=make_chunk(5)), 409, "in_progress"
    )


def test_unexpected_exception_is_a_generic_500(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> None:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(served.cache, "stats", broken)
    r = served.client.get("/v1/stats")
    assert_error(r, 500, "internal")
    assert "secret" not in r.text
    assert served.client.get("/healthz").status_code == 200


# -- auth, health, metrics, docs ----------------------------------------------------------------


def test_auth(serve_http: Callable[..., Served]) -> None:
    served = serve_http(auth_token=TOKEN)
    c = served.client
    good = {"Authorization": f"Bearer {TOKEN}"}
    for path in ("/healthz", "/readyz"):
        assert c.get(path).status_code == 200
    for path in ("/v1/stats", "/metrics", "/openapi.json", "/docs", "/v1/nope"):
        r = c.get(path)
        assert_error(r, 401, "unauthenticated", "missing")
        assert r.headers["www-authenticate"] == "Bearer"
        assert_error(
            c.get(path, headers={"Authorization": "Bearer wrong"}),
            401,
            "unauthenticated",
            "invalid",
        )
        assert_error(c.get(path, headers={"Authorization": TOKEN}), 401, "unauthenticated")
    for path in ("/v1/stats", "/metrics", "/openapi.json", "/docs"):
        assert c.get(path, headers=good).status_code == 200
    r = c.post("/v1/namespaces", json=make_namespace().to_dict())
    assert r.status_code == 401 and served.cache.stats().num_namespaces == 0
    r = c.post("/v1/namespaces", json=make_namespace().to_dict(), headers=good)
    assert r.status_code == 200
    spec = c.get("/openapi.json", headers=good).json()
    assert "HTTPBearer" in spec["components"]["securitySchemes"]


def test_auth_off_needs_no_header(served: Served) -> None:
    assert served.client.get("/v1/stats").status_code == 200
    assert served.client.get("/metrics").status_code == 200


def test_healthz_and_readyz(serve_http: Callable[..., Served]) -> None:
    ready = threading.Event()
    served = serve_http(ready=ready.is_set)
    assert served.client.get("/healthz").json() == {"status": "ok"}
    assert_error(served.client.get("/readyz"), 503, "not_ready")
    ready.set()
    r = served.client.get("/readyz")
    assert r.status_code == 200


def test_metrics_move_with_traffic(served: Served) -> None:
    from prometheus_client import CONTENT_TYPE_LATEST

    ns_hex = served.register(make_namespace())
    r = served.client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST
    before = r.text
    served.client.put(served.chunk_url(ns_hex, "01" * 32), content=make_chunk(6))
    served.client.put(served.chunk_url(ns_hex, "02" * 32), content=b"short")
    served.client.get(served.chunk_url(ns_hex, "01" * 32))
    after = served.client.get("/metrics").text
    put_201 = {"transport": "http", "method": "put_chunk", "code": "201"}
    assert metric_value(before, "lmcache_svc_requests_total", **put_201) == 0
    assert metric_value(after, "lmcache_svc_requests_total", **put_201) == 1
    assert metric_value(after, "lmcache_svc_requests_total", method="put_chunk", code="400") == 1
    assert metric_value(after, "lmcache_svc_requests_total", method="get_chunk", code="200") == 1
    assert metric_value(after, "lmcache_svc_requests_total", method="metrics", code="200") == 1
    assert metric_value(after, "lmcache_svc_errors_total", kind="size_mismatch") == 1
    assert (
        metric_value(
            after, "lmcache_svc_request_latency_seconds_count", transport="http", method="put_chunk"
        )
        == 2
    )
    assert metric_value(after, "lmcache_svc_tier_chunks", tier="cpu") == 1
    assert metric_value(after, "lmcache_svc_written_bytes_total", tier="cpu") == CHUNK_BYTES


def test_docs_and_openapi(served: Served) -> None:
    r = served.client.get("/docs")
    assert r.status_code == 200 and "swagger" in r.text.lower()
    spec = served.client.get("/openapi.json").json()
    chunk_ops = spec["paths"]["/v1/chunks/{namespace_id}/{chunk_hash}"]
    assert set(chunk_ops) == {"put", "get", "head", "delete"}
    assert "application/octet-stream" in chunk_ops["put"]["requestBody"]["content"]
    assert {"201", "200", "400", "404", "409", "413", "507"} <= set(chunk_ops["put"]["responses"])
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            assert op.get("summary"), (path, method)
    assert {
        "/v1/namespaces",
        "/v1/keys",
        "/v1/lookup",
        "/v1/stats",
        "/metrics",
        "/healthz",
        "/readyz",
    } <= set(spec["paths"])
    assert "NamespaceModel" in spec["components"]["schemas"]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_put_and_get_byte_identical(served: Served, tmp_path: Path) -> None:
    ns_hex = served.register(make_namespace())
    url = served.url + served.chunk_url(ns_hex, "77" * 32)
    src, dst = tmp_path / "chunk.bin", tmp_path / "back.bin"
    src.write_bytes(os.urandom(CHUNK_BYTES))

    def curl(*args: str) -> str:
        out = subprocess.run(
            ["curl", "-sS", "-w", "%{http_code}", *args],
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout

    put = curl(
        "-X", "PUT", "-H", "Content-Type: application/octet-stream", "--data-binary", f"@{src}", url
    )
    assert put.endswith("201") and json.loads(put[:-3]) == {"status": "stored"}
    assert curl("-o", str(dst), url) == "200"
    assert dst.read_bytes() == src.read_bytes()
    assert curl("-T", str(src), url).endswith("200")  # upload-file PUT: already stored


# -- the error mapping and the bearer check ------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "code", "status"),
    [
        (InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT, 400),
        (SizeMismatch("x"), grpc.StatusCode.INVALID_ARGUMENT, 400),
        (UnknownNamespace("x"), grpc.StatusCode.INVALID_ARGUMENT, 404),
        (PayloadTooLarge("x"), grpc.StatusCode.INVALID_ARGUMENT, 413),
        (NotFound("x"), grpc.StatusCode.NOT_FOUND, 404),
        (NoSpace("x"), grpc.StatusCode.RESOURCE_EXHAUSTED, 507),
        (Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED, 401),
        (TierError("x"), grpc.StatusCode.UNAVAILABLE, 503),
        (Corrupted("x"), grpc.StatusCode.UNAVAILABLE, 503),
        (ConfigError("x"), grpc.StatusCode.INTERNAL, 500),
        (ServerUnavailable("x"), grpc.StatusCode.INTERNAL, 500),
        (RuntimeError("x"), grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_status_mapping(exc: Exception, code: grpc.StatusCode, status: int) -> None:
    assert grpc_code(exc) == code
    assert http_status(exc) == status


def test_check_bearer() -> None:
    check_bearer(None, None)
    check_bearer("anything", None)
    check_bearer(f"Bearer {TOKEN}", TOKEN)
    check_bearer(f"bearer  {TOKEN} ", TOKEN)
    for header in (
        None,
        "",
        TOKEN,
        "Bearer",
        "Bearer ",
        "Basic abc",
        f"Bearer {TOKEN}x",
        "Bearer \u00e9",
    ):
        with pytest.raises(Unauthenticated):
            check_bearer(header, TOKEN)


def test_create_app_rejects_bad_settings() -> None:
    cache = make_cache()
    try:
        with pytest.raises(ConfigError):
            create_app(cache, auth_token="", max_body_bytes=1024)
        with pytest.raises(ConfigError):
            create_app(cache, max_body_bytes=0)
    finally:
        cache.close()

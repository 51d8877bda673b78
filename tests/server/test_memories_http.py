"""/v1/memories on the FastAPI app, served by uvicorn on a real socket and driven by httpx."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from lmcache_svc.server.memories.store import MemoryStore
from tests.server.memories.blobs import make_memory, memory_id_of
from tests.server.rest import App
from tests.server.test_http import TOKEN, assert_error, metric_value

MEMORIES = "/v1/memories"


@pytest.fixture
def app(serve_memories: Callable[..., App]) -> App:
    return serve_memories()


def post(app: App, blob: bytes) -> httpx.Response:
    return app.client.post(
        MEMORIES, content=blob, headers={"Content-Type": "application/octet-stream"}
    )


def test_create_read_list_delete(app: App) -> None:
    blob = make_memory(metadata={"source": "faq", "n": 1})
    mid = memory_id_of(blob)
    r = post(app, blob)
    assert r.status_code == 201, r.text
    body = {"memory_id": mid, "size_bytes": len(blob), "model": "test-model"}
    assert r.json() == {**body, "metadata": {"source": "faq", "n": 1}}
    again = post(app, blob)
    assert (again.status_code, again.json()) == (200, r.json())

    got = app.client.get(f"{MEMORIES}/{mid}")
    assert got.status_code == 200 and got.content == blob
    assert got.headers["content-type"] == "application/octet-stream"
    assert app.client.head(f"{MEMORIES}/{mid}").status_code == 204
    assert app.client.get(MEMORIES).json() == {"memories": [r.json()]}

    assert app.client.delete(f"{MEMORIES}/{mid}").status_code == 204
    assert_error(app.client.get(f"{MEMORIES}/{mid}"), 404, "not_found", mid)
    assert app.client.head(f"{MEMORIES}/{mid}").status_code == 404
    assert_error(app.client.delete(f"{MEMORIES}/{mid}"), 404, "not_found")
    assert app.client.get(MEMORIES).json() == {"memories": []}


def test_other_bytes_under_a_stored_id_are_409(app: App) -> None:
    blob = make_memory(seed=1)
    assert post(app, blob).status_code == 201
    r = post(app, make_memory(memory_id_of(blob), seed=2))
    assert_error(r, 409, "conflict", memory_id_of(blob), "other bytes")
    assert app.client.get(f"{MEMORIES}/{memory_id_of(blob)}").content == blob


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"", "shorter than the 8-byte prefix"),
        (b"PK\x03\x04 a zip file, not safetensors", "not safetensors"),
        (b"\x02\x00\x00\x00\x00\x00\x00\x00[]", "not a JSON object"),
        (make_memory()[:-1], "cover 96 bytes of data, but the blob holds 95"),
        (make_memory() + b"\x00", "holds 97 bytes"),
    ],
)
def test_bad_bodies_are_400_naming_the_problem(app: App, body: bytes, fragment: str) -> None:
    assert_error(post(app, body), 400, "bad_memory", fragment)
    assert app.store.usage().num_memories == 0


def test_bad_ids_are_400(app: App) -> None:
    for method in ("GET", "DELETE"):
        r = app.client.request(method, f"{MEMORIES}/not-a-uuid")
        assert_error(r, 400, "invalid_argument", "canonical lowercase UUID")
    assert app.client.head(f"{MEMORIES}/NOT-A-UUID").status_code == 400


def test_oversize_is_413_and_no_capacity_507(serve_memories: Callable[..., App]) -> None:
    blob = make_memory(seed=1)
    small = serve_memories(MemoryStore(capacity_bytes=len(blob), max_bytes=len(blob)))
    assert_error(post(small, blob + b"x"), 413, "payload_too_large", "memory.max_bytes")
    chunked = small.client.post(MEMORIES, content=iter([blob, b"more"]))  # no Content-Length
    assert_error(chunked, 413, "payload_too_large", "at least")
    assert post(small, blob).status_code == 201
    assert_error(post(small, make_memory(seed=2)), 507, "no_space", "memory.capacity")


def test_server_body_limit_still_applies(serve_memories: Callable[..., App]) -> None:
    app = serve_memories(max_body_bytes=100)
    assert_error(post(app, make_memory()), 413, "payload_too_large", "100 bytes")


def test_auth_covers_memories(serve_memories: Callable[..., App]) -> None:
    app = serve_memories(auth_token=TOKEN)
    blob = make_memory()
    assert_error(post(app, blob), 401, "unauthenticated")
    assert_error(app.client.get(MEMORIES), 401, "unauthenticated")
    good = {"Authorization": f"Bearer {TOKEN}"}
    assert app.client.post(MEMORIES, content=blob, headers=good).status_code == 201
    assert len(app.client.get(MEMORIES, headers=good).json()["memories"]) == 1
    spec = app.client.get("/openapi.json", headers=good).json()
    assert spec["paths"][MEMORIES]["post"]["security"] == [{"HTTPBearer": []}]


def test_openapi_documents_every_memory_endpoint(app: App) -> None:
    spec = app.client.get("/openapi.json").json()
    collection, item = spec["paths"][MEMORIES], spec["paths"][MEMORIES + "/{memory_id}"]
    assert set(collection) == {"get", "post"} and set(item) == {"get", "head", "delete"}
    post_op = collection["post"]
    assert post_op["operationId"] == "put_memory"
    assert "application/octet-stream" in post_op["requestBody"]["content"]
    assert post_op["requestBody"]["required"] is True
    assert {"200", "201", "400", "409", "413", "507"} <= set(post_op["responses"])
    assert "application/octet-stream" in item["get"]["responses"]["200"]["content"]
    assert {"400", "404"} <= set(item["delete"]["responses"])
    assert set(item["head"]["responses"]) >= {"204", "400", "404"}
    (param,) = item["get"]["parameters"]
    assert param["schema"]["format"] == "uuid" and param["schema"]["pattern"].startswith(
        "^[0-9a-f]"
    )
    model = spec["components"]["schemas"]["MemoryModel"]
    assert model["properties"]["memory_id"]["format"] == "uuid"
    assert set(model["required"]) == {"memory_id", "size_bytes", "model", "metadata"}
    for op in (*collection.values(), *item.values()):
        assert op["summary"] and op["tags"] == ["memories"]


def test_metrics_count_memories_and_bytes(tmp_path: Path) -> None:
    from lmcache_svc.metrics import Metrics

    store = MemoryStore(capacity_bytes=4096, max_bytes=4096, path=tmp_path)
    metrics = Metrics()
    metrics.watch_memories(store.usage)
    blob = make_memory()
    store.put("default", blob)
    text = metrics.exposition().decode()
    assert metric_value(text, "lmcache_svc_memories") == 1
    assert metric_value(text, "lmcache_svc_memory_used_bytes") == len(blob)
    assert metric_value(text, "lmcache_svc_memory_capacity_bytes") == 4096
    store.delete("default", memory_id_of(blob))
    text = metrics.exposition().decode()
    assert metric_value(text, "lmcache_svc_memories") == 0
    assert metric_value(text, "lmcache_svc_memory_used_bytes") == 0


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_curl_examples_of_the_docs(app: App, tmp_path: Path) -> None:
    s = str(app.client.base_url).rstrip("/")
    src, back = tmp_path / "memory.safetensors", tmp_path / "back.safetensors"
    src.write_bytes(make_memory(metadata={"source": "faq"}))
    mid = memory_id_of(src.read_bytes())

    def curl(*args: str) -> str:
        out = subprocess.run(
            ["curl", "-sS", *args], check=True, capture_output=True, text=True, timeout=10
        )
        return out.stdout

    stored = json.loads(
        curl(
            "-X",
            "POST",
            f"{s}/v1/memories",
            "-H",
            "Content-Type: application/octet-stream",
            "--data-binary",
            f"@{src}",
        )
    )
    assert stored["memory_id"] == mid and stored["metadata"] == {"source": "faq"}
    assert json.loads(curl(f"{s}/v1/memories"))["memories"] == [stored]
    curl("-o", str(back), f"{s}/v1/memories/{mid}")
    assert back.read_bytes() == src.read_bytes()
    assert curl("-I", f"{s}/v1/memories/{mid}").startswith("HTTP/1.1 204")
    assert curl("-X", "DELETE", "-w", "%{http_code}", f"{s}/v1/memories/{mid}") == "204"

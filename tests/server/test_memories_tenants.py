"""Named memories behind per-tenant tokens: each token sees only its own tenant's memories,
read-only tokens cannot create or delete them, on REST and gRPC alike."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from lmcache_svc import errors
from lmcache_svc.client import CacheClient
from lmcache_svc.server.tokens import Authenticator
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.server.memories.blobs import make_memory, memory_id_of
from tests.server.rest import App
from tests.server.test_memories_http import MEMORIES
from tests.server.test_tenants import ACME, ACME_READER, ADMIN, BOB, bearer, tokens_file  # noqa: F401


def test_rest_memories_are_walled_off_by_tenant(
    serve_memories: Callable[..., App],
    tokens_file: Path,  # noqa: F811
) -> None:
    app = serve_memories(auth=Authenticator(tokens_file=tokens_file))
    blob = make_memory(seed=1)
    memory_id = memory_id_of(blob)
    created = app.client.post(MEMORIES, content=blob, headers=bearer(ACME))
    assert created.status_code == 201, created.text
    item = f"{MEMORIES}/{memory_id}"
    assert app.client.get(item, headers=bearer(ACME)).content == blob
    assert app.client.get(item, headers=bearer(ACME_READER)).content == blob  # same tenant
    # Another tenant sees nothing and cannot delete it; the admin token acts for 'default'.
    for token in (BOB, ADMIN):
        assert app.client.get(item, headers=bearer(token)).status_code == 404
        assert app.client.get(MEMORIES, headers=bearer(token)).json()["memories"] == []
        assert app.client.delete(item, headers=bearer(token)).status_code == 404
    assert app.client.get(item, headers=bearer(ACME)).content == blob
    # A read-only token reads but never writes.
    other = make_memory(seed=2)
    refused = app.client.post(MEMORIES, content=other, headers=bearer(ACME_READER))
    assert refused.status_code == 403, refused.text
    assert app.client.delete(item, headers=bearer(ACME_READER)).status_code == 403
    assert app.client.delete(item, headers=bearer(ACME)).status_code == 204


def test_rest_memory_bodies_are_not_held_to_the_json_limit(
    serve_memories: Callable[..., App],
    tokens_file: Path,  # noqa: F811
) -> None:
    """A memory body is binary, bounded by memory.max_bytes, not by http.max_json_bytes."""
    app = serve_memories(auth=Authenticator(tokens_file=tokens_file), max_json_bytes=1024)
    blob = make_memory(tensors={"layers.0.keys": ("U8", [4096], bytes(4096))})
    assert len(blob) > 1024
    created = app.client.post(MEMORIES, content=blob, headers=bearer(ACME))
    assert created.status_code == 201, created.text


@pytest.fixture
def grpc_server(tmp_path: Path, tokens_file: Path) -> Iterator[ServerProc]:  # noqa: F811
    proc = start_server(tmp_path, env={"LMCACHE_SVC_TOKENS_FILE": str(tokens_file)})
    yield proc
    proc.cleanup()


def test_grpc_memories_are_walled_off_by_tenant(grpc_server: ServerProc) -> None:
    blob = make_memory(seed=3)
    memory_id = memory_id_of(blob)
    with CacheClient(grpc_server.grpc, auth_token=ACME) as acme:
        acme.wait_ready()
        assert acme.put_memory(blob).memory_id == memory_id
    with CacheClient(grpc_server.grpc, auth_token=BOB) as bob:
        assert bob.get_memory(memory_id) is None
        assert bob.list_memories() == []
        assert bob.delete_memory(memory_id) is False
    with CacheClient(grpc_server.grpc, auth_token=ACME_READER) as reader:
        assert reader.get_memory(memory_id) == blob
        with pytest.raises(errors.PermissionDenied, match="read-only"):
            reader.put_memory(make_memory(seed=4))
        with pytest.raises(errors.PermissionDenied, match="read-only"):
            reader.delete_memory(memory_id)
    with CacheClient(grpc_server.grpc, auth_token=ACME) as acme:
        assert [m.memory_id for m in acme.list_memories()] == [memory_id]
        assert acme.delete_memory(memory_id) is True
    with CacheClient(grpc_server.grpc) as anonymous, pytest.raises(errors.Unauthenticated):
        anonymous.list_memories()


def test_rest_tokens_reach_grpc_memories_of_the_same_tenant(grpc_server: ServerProc) -> None:
    """A memory put over gRPC is the same tenant's memory over REST."""
    blob = make_memory(seed=5)
    with CacheClient(grpc_server.grpc, auth_token=ACME) as acme:
        acme.wait_ready()
        acme.put_memory(blob)
    url = f"{grpc_server.http_url}{MEMORIES}/{memory_id_of(blob)}"
    assert httpx.get(url, headers=bearer(ACME), timeout=10).content == blob
    assert httpx.get(url, headers=bearer(BOB), timeout=10).status_code == 404

"""Named memories on real server processes: gRPC client processes, REST, restarts."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lmcache_svc import errors
from lmcache_svc.client import CacheClient, MemoryInfo
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.server.memories.blobs import make_memory, memory_id_of
from tests.server.test_grpc import run_py
from tests.server.test_http import metric_value

MID = "3b241101-e2bb-4255-8caf-4136c566a962"


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[ServerProc]]:
    started: list[ServerProc] = []
    yield started
    for proc in started:
        proc.cleanup()


def ready_client(address: str, **kwargs: Any) -> CacheClient:
    """A client whose channel is connected, with deadlines generous for a loaded host."""
    client = CacheClient(address, timeout_s=30, **kwargs)
    client.wait_ready(30)
    return client


def start(servers: list[ServerProc], tmp_path: Path, *args: str, **env: str) -> ServerProc:
    proc = start_server(tmp_path, *args, env=env)
    servers.append(proc)
    return proc


def test_a_memory_added_by_one_process_is_seen_by_another(
    servers: list[ServerProc], tmp_path: Path
) -> None:
    server = start(servers, tmp_path)
    writer = f"""
        from lmcache_svc.client import CacheClient
        from tests.server.memories.blobs import make_memory
        c = CacheClient({server.socket!r}, timeout_s=30)
        c.wait_ready(30)
        with c:
            info = c.put_memory(make_memory({MID!r}, seed=3, metadata={{"doc": "faq"}}))
            print(info.memory_id)
    """
    assert run_py(writer).strip() == MID
    reader = f"""
        import hashlib, json
        from lmcache_svc.client import CacheClient
        c = CacheClient({server.grpc!r}, timeout_s=30)
        c.wait_ready(30)
        with c:
            (info,) = c.list_memories()
            blob = c.get_memory(info.memory_id)
            print(json.dumps([info.memory_id, info.size_bytes, info.model, info.metadata,
                              hashlib.sha256(blob).hexdigest()]))
    """
    expected = make_memory(MID, seed=3, metadata={"doc": "faq"})
    got = json.loads(run_py(reader))
    assert got == [
        MID,
        len(expected),
        "test-model",
        {"doc": "faq"},
        hashlib.sha256(expected).hexdigest(),
    ]


def test_client_semantics(servers: list[ServerProc], tmp_path: Path) -> None:
    server = start(servers, tmp_path)
    blob = make_memory(MID, seed=1)
    with ready_client(server.socket) as c:
        info = c.put_memory(blob)
        assert info == MemoryInfo(MID, len(blob), "test-model", {"source": "test"})
        assert c.put_memory(memoryview(blob)) == info  # same bytes: idempotent
        with pytest.raises(errors.Conflict, match="other bytes"):
            c.put_memory(make_memory(MID, seed=2))
        assert c.get_memory(MID) == blob
        assert c.list_memories() == [info]
        assert c.get_memory("00000000-0000-4000-8000-000000000000") is None
        with pytest.raises(errors.InvalidArgument, match="canonical lowercase UUID"):
            c.get_memory("../../etc/passwd")
        assert c.delete_memory(MID) is True
        assert c.delete_memory(MID) is False
        assert c.get_memory(MID) is None and c.list_memories() == []


def test_bad_bodies_oversize_and_capacity_over_grpc(
    servers: list[ServerProc], tmp_path: Path
) -> None:
    blob = make_memory(seed=1)
    server = start(
        servers,
        tmp_path,
        "--memory-bytes",
        str(2 * len(blob)),
        LMCACHE_SVC_MEMORY__MAX_BYTES=str(len(blob)),
    )
    with ready_client(server.socket) as c:
        with pytest.raises(errors.BadMemory, match="not safetensors"):
            c.put_memory(b"\x00" * 64)
        with pytest.raises(errors.PayloadTooLarge, match="memory.max_bytes"):
            c.put_memory(blob + b"\x00")
        c.put_memory(blob)
        c.put_memory(make_memory(seed=2))
        with pytest.raises(errors.NoSpace, match="memory.capacity"):
            c.put_memory(make_memory(seed=3))
        assert len(c.list_memories()) == 2
        # REST shares the store and its limit
        r = httpx.post(f"{server.http_url}/v1/memories", content=make_memory(seed=4))
        assert r.status_code == 507 and r.json()["error"] == "no_space"
        metrics = httpx.get(f"{server.http_url}/metrics").text
        assert metric_value(metrics, "lmcache_svc_memories") == 2
        assert metric_value(metrics, "lmcache_svc_memory_used_bytes") == 2 * len(blob)


def test_memories_survive_a_restart_with_a_memory_path(
    servers: list[ServerProc], tmp_path: Path
) -> None:
    path = tmp_path / "memories"
    blob = make_memory(MID, seed=1)
    first = start(servers, tmp_path, "--memory-path", str(path))
    r = httpx.post(f"{first.http_url}/v1/memories", content=blob)
    assert r.status_code == 201, r.text
    first.kill()  # no clean shutdown: the put was durable when it returned

    second = start(servers, tmp_path, "--memory-path", str(path))
    with ready_client(second.socket) as c:
        assert c.get_memory(MID) == blob
        assert [i.memory_id for i in c.list_memories()] == [MID]
        assert c.delete_memory(MID)
    assert second.stop() == 0

    third = start(servers, tmp_path, "--memory-path", str(path))
    with ready_client(third.socket) as c:
        assert c.list_memories() == []  # the delete persisted too


def test_memories_persist_under_the_ssd_tier_by_default(
    servers: list[ServerProc], tmp_path: Path
) -> None:
    ssd = tmp_path / "ssd"
    blob = make_memory(MID)
    first = start(servers, tmp_path, "--ssd-path", str(ssd))
    with ready_client(first.socket) as c:
        c.put_memory(blob)
    assert first.stop() == 0
    assert [p.name for p in (ssd / "memories").glob("t-*/*")] == [f"{MID}.safetensors"]
    second = start(servers, tmp_path, "--ssd-path", str(ssd))
    with ready_client(second.socket) as c:
        assert c.get_memory(MID) == blob


def test_without_a_persistent_path_memories_live_in_ram_only(
    servers: list[ServerProc], tmp_path: Path
) -> None:
    first = start(servers, tmp_path)
    with ready_client(first.socket) as c:
        c.put_memory(make_memory(MID))
    assert first.stop() == 0
    second = start(servers, tmp_path)
    with ready_client(second.socket) as c:
        assert c.list_memories() == []


def test_memories_need_the_token_over_grpc(servers: list[ServerProc], tmp_path: Path) -> None:
    token = "memory-test-token-0123"
    server = start(servers, tmp_path, LMCACHE_SVC_AUTH_TOKEN=token)
    blob = make_memory(MID)
    with ready_client(server.socket) as anonymous:
        with pytest.raises(errors.Unauthenticated):
            anonymous.put_memory(blob)
        with pytest.raises(errors.Unauthenticated):
            anonymous.list_memories()
    with ready_client(server.socket, auth_token=token) as c:
        assert c.put_memory(blob).memory_id == memory_id_of(blob)
        assert c.get_memory(MID) == blob


def test_the_client_raises_the_servers_error_class(
    servers: list[ServerProc], tmp_path: Path
) -> None:
    """The error kind in the trailing metadata names the class (not a bare
    LMCacheSvcError("UNKNOWN: ..."))."""
    server = start(servers, tmp_path)
    with ready_client(server.grpc) as c:
        with pytest.raises(errors.UnknownNamespace):
            c.lookup(b"\x01" * 16, [b"\x02" * 32])
        with pytest.raises(errors.BadMemory, match="not safetensors"):
            c.put_memory(b"junk")

"""The gRPC server on real sockets, in its own process, driven by the Python client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmcache_svc import errors
from lmcache_svc.client import CacheClient
from lmcache_svc.keys import chunk_hashes
from lmcache_svc.v1 import cache_pb2 as pb
from lmcache_svc.v1 import cache_pb2_grpc as pb_grpc
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.helpers import make_chunk, make_namespace, wait_until

ROOT = Path(__file__).resolve().parents[2]


NS = make_namespace(chunk_size=256)
CHUNK = NS.chunk_bytes  # 64 KiB


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProc]:
    proc = start_server(tmp_path)
    yield proc
    proc.cleanup()


def run_py(code: str, timeout_s: float = 60) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_store_in_one_process_load_in_another(server: ServerProc) -> None:
    store = f"""
        from lmcache_svc.client import CacheClient
        from tests.server.test_grpc import CHUNK, NS, make_chunk
        from lmcache_svc.keys import chunk_hashes
        with CacheClient({server.socket!r}) as c:
            assert c.shm_available
            ns_id = c.register_namespace(NS)
            hashes = chunk_hashes(NS, list(range(1000)))
            slots = c.prepare_store(ns_id, hashes)
            for i, s in enumerate(slots):
                s.buffer[:] = make_chunk(i, CHUNK)
            print(c.commit_store(ns_id, hashes))
    """
    assert run_py(store).strip() == "3"
    load = f"""
        from lmcache_svc.client import CacheClient
        from tests.server.test_grpc import CHUNK, NS, make_chunk
        from lmcache_svc.keys import chunk_hashes
        with CacheClient({server.grpc!r}) as c:
            ns_id = c.register_namespace(NS)
            hashes = chunk_hashes(NS, list(range(1000)))
            lease = c.prepare_load(ns_id, hashes)
            print(all(bytes(b) == make_chunk(i, CHUNK) for i, b in enumerate(lease.buffers)),
                  len(lease.buffers), c.release_load(lease))
    """
    assert run_py(load).split() == ["True", "3", "True"]


def test_inline_put_get_delete_and_a_second_client(server: ServerProc) -> None:
    hashes = chunk_hashes(NS, list(range(512)))
    with CacheClient(server.grpc, use_shm=False) as c:
        ns_id = c.register_namespace(NS)
        assert not c.shm_available
        assert c.store(ns_id, hashes, [make_chunk(0, CHUNK), make_chunk(1, CHUNK)]) == 2
        assert c.load(ns_id, hashes) == [make_chunk(0, CHUNK), make_chunk(1, CHUNK)]
        assert c.get(ns_id, [hashes[1], b"\0" * 32]) == [make_chunk(1, CHUNK), None]

    with CacheClient(server.socket) as a:
        a.register_namespace(NS)
        got = a.get(ns_id, hashes)
        hits = a.lookup(ns_id, hashes).num_hit_chunks
        deleted = a.delete(ns_id, hashes)
        left = a.stats()["tiers"][0]["num_chunks"]
    assert (
        got == [make_chunk(0, CHUNK), make_chunk(1, CHUNK)]
        and hits == 2
        and deleted == 2
        and left == 0
    )


def test_a_client_killed_mid_store_gives_its_slots_back(server: ServerProc) -> None:
    code = f"""
        import os, signal
        from lmcache_svc.client import CacheClient
        from tests.server.test_grpc import NS
        from lmcache_svc.keys import chunk_hashes
        c = CacheClient({server.socket!r})
        ns_id = c.register_namespace(NS)
        slots = c.prepare_store(ns_id, chunk_hashes(NS, list(range(2560))))
        print(sum(s.status == "reserved" for s in slots), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == -signal.SIGKILL and proc.stdout.strip() == "10"
    with CacheClient(server.socket) as c:
        wait_until(lambda: c.stats()["pending_stores"] == 0, 10, "the dead writer's slots back")
        stats = c.stats()
        assert stats["pending_stores"] == 0
        assert stats["tiers"][0]["used_bytes"] == 0


def raw_stub(server: ServerProc) -> pb_grpc.CacheServiceStub:
    return pb_grpc.CacheServiceStub(grpc.insecure_channel(server.grpc))


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.LookupRequest(namespace_id=b"x", chunk_hashes=[]), "namespace id must be 16 bytes"),
        (pb.LookupRequest(namespace_id=b"\1" * 16, chunk_hashes=[]), "not registered"),
        (
            pb.LookupRequest(namespace_id=NS.namespace_id, chunk_hashes=[b"short"]),
            "chunk hash must be 32 bytes",
        ),
    ],
)
def test_bad_requests_get_invalid_argument(server: ServerProc, request_, message: str) -> None:
    stub = raw_stub(server)
    stub.RegisterNamespace(
        pb.RegisterNamespaceRequest(
            namespace=pb.Namespace(
                model="m",
                layout=pb.KVLayout(
                    dtype="uint8",
                    num_layers=1,
                    num_kv_heads=1,
                    head_size=128,
                    block_size=16,
                    page_layout="test",
                    kv_planes=2,
                ),
                chunk_size=256,
                tp_size=1,
                tenant="default",
                key_version=1,
            )
        )
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.Lookup(request_, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_bad_namespace_and_wrong_sizes(server: ServerProc) -> None:
    stub = raw_stub(server)
    with pytest.raises(grpc.RpcError) as info:
        stub.RegisterNamespace(pb.RegisterNamespaceRequest(namespace=pb.Namespace(model="m")))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "layout" in info.value.details()
    with CacheClient(server.grpc, use_shm=False) as c:
        ns_id = c.register_namespace(NS)
        h = chunk_hashes(NS, list(range(256)))[0]
        with pytest.raises(errors.SizeMismatch, match=str(NS.chunk_bytes)):
            c.put(ns_id, [(h, b"x" * 100)])
        with pytest.raises(errors.PayloadTooLarge):
            c.lookup(ns_id, [h] * 9000)
        stats = c.stats()
        assert stats["pending_stores"] == 0 and stats["tiers"][0]["num_chunks"] == 0


def test_client_recovers_after_a_server_restart(tmp_path: Path) -> None:
    sock = f"/tmp/lmc-restart-{os.getpid()}.sock"
    first = start_server(tmp_path, socket_path=sock)
    client = CacheClient(sock, timeout_s=2)
    try:
        ns_id = client.register_namespace(NS)
        hashes = chunk_hashes(NS, list(range(256)))
        assert client.store(ns_id, hashes, [make_chunk(0, CHUNK)]) == 1
        first.kill()
        with pytest.raises(errors.ServerUnavailable):
            client.lookup(ns_id, hashes)
        second = start_server(tmp_path, socket_path=sock)
        try:
            client.wait_ready(10)
            # the new server knows neither the namespace nor the session: both are redone
            assert client.lookup(ns_id, hashes).num_hit_chunks == 0
            assert client.store(ns_id, hashes, [make_chunk(5, CHUNK)]) == 1
            assert client.load(ns_id, hashes) == [make_chunk(5, CHUNK)]
        finally:
            second.cleanup()
    finally:
        client.close()
        first.cleanup()


def test_sigterm_removes_segment_and_socket(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        assert Path("/dev/shm", server.shm).exists() and Path(server.socket).exists()
        with CacheClient(server.socket) as c:
            c.store(
                c.register_namespace(NS), chunk_hashes(NS, list(range(256))), [make_chunk(1, CHUNK)]
            )
        assert server.stop() == 0
        assert not Path("/dev/shm", server.shm).exists()
        assert not Path(server.socket).exists()
    finally:
        server.cleanup()


def test_health_service_and_metrics_move(server: ServerProc) -> None:
    channel = grpc.insecure_channel(server.grpc)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "lmcache_svc.v1.CacheService"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    with CacheClient(server.socket) as c:
        ns_id = c.register_namespace(NS)
        hashes = chunk_hashes(NS, list(range(768)))
        c.store(ns_id, hashes[:2], [make_chunk(0, CHUNK), make_chunk(1, CHUNK)])
        c.lookup(ns_id, hashes)
        c.load(ns_id, hashes)
    text = httpx.get(f"{server.http_url}/metrics", timeout=5).text
    assert 'lmcache_svc_chunk_hits_total{tier="cpu"} 2.0' in text
    assert "lmcache_svc_chunk_misses_total 1.0" in text
    assert 'lmcache_svc_tier_chunks{tier="cpu"} 2.0' in text
    assert f'lmcache_svc_written_bytes_total{{tier="cpu"}} {float(2 * NS.chunk_bytes)}' in text
    assert (
        'lmcache_svc_requests_total{code="OK",method="PrepareStore",transport="grpc"} 1.0' in text
    )


def test_auth_token_is_required_when_set(tmp_path: Path) -> None:
    token = "s3cret-token-for-tests"
    server = start_server(tmp_path, env={"LMCACHE_SVC_AUTH_TOKEN": token})
    try:
        with CacheClient(server.grpc) as anonymous:
            with pytest.raises(errors.Unauthenticated):
                anonymous.stats()
        with CacheClient(server.grpc, auth_token=token) as c:
            assert c.stats()["tiers"][0]["name"] == "cpu"
            assert c.shm_available
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.grpc))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
        assert httpx.get(f"{server.http_url}/v1/stats", timeout=5).status_code == 401
    finally:
        server.cleanup()


def test_concurrent_clients_with_a_small_arena(tmp_path: Path) -> None:
    # Eviction under concurrent stores and loads. The clients are one tenant: with its
    # reservation quota (75% of the arena) some of their stores would be refused when
    # several reserve at once (ReservationLimit, the quota's behaviour, tested in
    # tests/cache/test_quotas.py); here the tenant may reserve the whole arena (16 chunks),
    # more than five clients' three chunks each.
    server = start_server(
        tmp_path,
        "--cpu-bytes",
        "1MiB",
        "--prefault",
        "sync",
        env={"LMCACHE_SVC_CACHE__MAX_TENANT_RESERVED_FRACTION": "1"},
    )
    capacity = 1 << 20
    failures: list[BaseException] = []
    peaks: list[int] = []

    def worker(seed: int) -> None:
        try:
            with CacheClient(server.socket) as c:
                ns_id = c.register_namespace(NS)
                for round_ in range(30):
                    tokens = [seed * 1000 + round_ % 7] * 256 * 3
                    hashes = chunk_hashes(NS, tokens)
                    c.store(ns_id, hashes, [make_chunk(seed + i, CHUNK) for i in range(3)])
                    got = c.load(ns_id, hashes)
                    for i, data in enumerate(got):
                        assert data == make_chunk(seed + i, CHUNK)
        except BaseException as e:
            failures.append(e)

    def poll(stop: threading.Event) -> None:
        with CacheClient(server.socket, use_shm=False) as c:
            while not stop.is_set():
                peaks.append(c.stats()["tiers"][0]["used_bytes"])

    stop = threading.Event()
    poller = threading.Thread(target=poll, args=(stop,))
    poller.start()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(5)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        stop.set()
        poller.join()
        server.cleanup()
    assert not failures, failures[0]
    assert peaks and max(peaks) <= capacity


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``lmcache-svc *args`` in a fresh interpreter, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "lmcache_svc", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_bad_config_exits_with_a_clear_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("cpu:\n  capacity: lots\ncache:\n  low_watermark: 0.99\n")
    out = run_cli("serve", "--config", str(bad))
    assert out.returncode == 2
    assert "cpu.capacity" in out.stderr and "low_watermark" in out.stderr
    exposed = run_cli("serve", "--host", "0.0.0.0")
    assert exposed.returncode == 2 and "auth_token" in exposed.stderr


def test_stats_command(server: ServerProc) -> None:
    out = run_cli("stats", "--url", server.socket)
    assert out.returncode == 0, out.stderr
    assert "cpu" in out.stdout and "256.0 MiB" in out.stdout
    down = run_cli("stats", "--url", "/tmp/nope.sock", "--timeout", "1")
    assert down.returncode == 1 and "unavailable" in down.stderr


def test_a_fixed_segment_name_survives_a_hard_kill(tmp_path: Path) -> None:
    name = f"lmcache-svc-test-{os.getpid()}"
    sock = f"/tmp/lmc-fixed-{os.getpid()}.sock"
    args = ("--shm-name", name)
    first = start_server(tmp_path, *args, socket_path=sock)
    first.proc.kill()  # no clean-up: the segment and the socket file stay
    first.proc.wait()
    assert Path("/dev/shm", name).exists()
    second = start_server(
        tmp_path, *args, socket_path=sock, env={"LMCACHE_SVC_SOCKET_MODE": "0o660"}
    )
    try:
        assert oct(os.stat(sock).st_mode & 0o777) == "0o660"
        with CacheClient(sock) as c:
            assert c.shm_available
            assert (
                c.store(
                    c.register_namespace(NS), chunk_hashes(NS, range(256)), [make_chunk(0, CHUNK)]
                )
                == 1
            )
        with pytest.raises(RuntimeError, match="already listening"):
            start_server(tmp_path, *args, socket_path=sock, timeout_s=15)
        assert Path("/dev/shm", name).exists()  # the live server's segment was left alone
    finally:
        second.cleanup()
        first.cleanup()

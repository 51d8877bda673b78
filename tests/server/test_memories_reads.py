"""Memory reads over REST and gRPC: verified before they are served, streamed a piece at a
time, capped in number, and never run on the event loop."""

from __future__ import annotations

import os
import socket
import struct
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import xxhash

from lmcache_svc import errors
from lmcache_svc.client import CacheClient
from lmcache_svc.server.memories.store import MemoryStore
from lmcache_svc.v1 import cache_pb2 as pb
from lmcache_svc.v1 import cache_pb2_grpc as pb_grpc
from lmcache_svc.wire import channel_options
from tests.helpers import wait_until
from tests.server.inprocess import InProcessServer
from tests.server.inprocess import serve as serve  # the fixture
from tests.server.memories.blobs import make_memory, memory_id_of
from tests.server.rest import App
from tests.server.test_http import assert_error, metric_value

MIB = 1 << 20


def big_memory(mib: int) -> bytes:
    return make_memory(tensors={"t": ("U8", [mib, MIB], os.urandom(mib * MIB))})


def disk_store(tmp_path: Path, **kwargs: int) -> MemoryStore:
    return MemoryStore(
        capacity_bytes=512 * MIB, max_bytes=256 * MIB, path=tmp_path / "memories", **kwargs
    )


def corrupt(store: MemoryStore, memory_id: str) -> None:
    assert store.path is not None
    (file,) = store.path.glob(f"t-*/{memory_id}*")
    with open(file, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))


class Peak:
    """The most memory Python allocated (tracemalloc) above where it was at the start."""

    def __enter__(self) -> Peak:
        tracemalloc.start()
        self.base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        return self

    def __exit__(self, *exc: object) -> None:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        self.mib = (peak - self.base) / MIB


# -- REST -----------------------------------------------------------------------------------


@pytest.fixture
def on_disk(serve_memories: Callable[..., App], tmp_path: Path) -> App:
    return serve_memories(disk_store(tmp_path, max_transfers=2), max_body_bytes=256 * MIB)


def test_rest_reads_stream_and_hold_one_piece(on_disk: App) -> None:
    blob = big_memory(48)
    mid, digest, size = memory_id_of(blob), xxhash.xxh3_64_hexdigest(blob), len(blob)
    assert on_disk.client.post("/v1/memories", content=blob).status_code == 201
    del blob
    got = xxhash.xxh3_64()
    with Peak() as peak, on_disk.client.stream("GET", f"/v1/memories/{mid}") as r:
        assert r.status_code == 200 and r.headers["content-length"] == str(size)
        for piece in r.iter_raw():
            got.update(piece)
    assert got.hexdigest() == digest
    assert peak.mib < 12, f"a 48 MiB GET held {peak.mib:.0f} MiB in the server and client"


def test_rest_a_corrupted_memory_is_500_counted_and_gone(on_disk: App) -> None:
    blob = make_memory(seed=3)
    mid = memory_id_of(blob)
    on_disk.client.post("/v1/memories", content=blob)
    corrupt(on_disk.store, mid)
    r = on_disk.client.get(f"/v1/memories/{mid}")
    assert_error(r, 500, "memory_corrupted", mid, "checksum", "quarantine")
    assert_error(on_disk.client.get(f"/v1/memories/{mid}"), 404, "not_found")
    assert on_disk.client.get("/v1/memories").json() == {"memories": []}
    metrics = on_disk.client.get("/metrics").text
    assert metric_value(metrics, "lmcache_svc_memory_corrupted_total") == 1
    assert metric_value(metrics, 'lmcache_svc_errors_total{kind="memory_corrupted"}') == 1


def test_rest_reads_beyond_the_cap_are_429_until_one_ends(on_disk: App) -> None:
    blob = big_memory(16)
    mid = memory_id_of(blob)
    on_disk.client.post("/v1/memories", content=blob)
    url = f"{on_disk.client.base_url}/v1/memories/{mid}"
    held = [httpx.Client(timeout=30) for _ in range(2)]
    streams = [c.stream("GET", url) for c in held]
    try:
        for s in streams:  # both open, their bodies not read: two transfers in flight
            assert s.__enter__().status_code == 200
        assert_error(on_disk.client.get(url), 429, "too_busy", "memory.max_transfers")
        assert_error(
            on_disk.client.post("/v1/memories", content=make_memory(seed=1)), 429, "too_busy"
        )
    finally:
        for s, c in zip(streams, held):
            s.__exit__(None, None, None)
            c.close()
    # the server notices the closed connections
    wait_until(lambda: on_disk.client.get(url).status_code != 429, 30, "the transfers given back")
    r = on_disk.client.get(url)
    assert r.status_code == 200 and r.content == blob


# -- gRPC ----------------------------------------------------------------------------------


def _read_unless_busy(client: CacheClient, memory_id: str) -> bool:
    """Whether a read of ``memory_id`` got a transfer slot (False: ``TooBusy``)."""
    try:
        client.get_memory(memory_id)
    except errors.TooBusy:
        return False
    return True


@pytest.fixture
def grpc_memories(
    serve: Callable[..., InProcessServer], tmp_path: Path
) -> Iterator[tuple[InProcessServer, CacheClient]]:
    server = serve(memories=disk_store(tmp_path, max_transfers=2))
    with CacheClient(server.socket, timeout_s=30) as client:
        yield server, client


def test_grpc_reads_stream_and_hold_one_piece(
    grpc_memories: tuple[InProcessServer, CacheClient],
) -> None:
    server, client = grpc_memories
    blob = big_memory(48)
    mid, digest = memory_id_of(blob), xxhash.xxh3_64_hexdigest(blob)
    client.put_memory(blob)
    del blob
    got = xxhash.xxh3_64()
    with grpc.insecure_channel(f"unix:{server.socket}", options=channel_options()) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)
        with Peak() as peak:
            for part in stub.GetMemory(pb.GetMemoryRequest(memory_id=mid), timeout=30):
                got.update(part.data)
    assert got.hexdigest() == digest
    # Well under the memory (48 MiB) and its copies: the server holds the piece being read and
    # the one held back until the checksum is confirmed (integrity.MemoryRead.pieces).
    assert peak.mib < 30, f"a 48 MiB GetMemory held {peak.mib:.0f} MiB"


def test_grpc_a_corrupted_memory_is_data_loss(
    grpc_memories: tuple[InProcessServer, CacheClient],
) -> None:
    server, client = grpc_memories
    blob = make_memory(seed=4)
    mid = memory_id_of(blob)
    client.put_memory(blob)
    assert server.memories is not None
    corrupt(server.memories, mid)
    with pytest.raises(errors.MemoryCorrupted, match=f"memory {mid} differs from the checksum"):
        client.get_memory(mid)
    assert client.get_memory(mid) is None and client.list_memories() == []
    assert server.memories.usage().num_corrupted == 1


def test_grpc_reads_beyond_the_cap_are_resource_exhausted(
    grpc_memories: tuple[InProcessServer, CacheClient],
) -> None:
    server, client = grpc_memories
    blob = big_memory(16)
    mid = memory_id_of(blob)
    client.put_memory(blob)
    with grpc.insecure_channel(f"unix:{server.socket}", options=channel_options()) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)
        calls = [stub.GetMemory(pb.GetMemoryRequest(memory_id=mid), timeout=30) for _ in range(2)]
        for call in calls:  # each got its header: its read is open, two transfers in flight
            assert next(call).header.found
        with pytest.raises(errors.TooBusy, match="memory.max_transfers"):
            client.get_memory(mid)
        for call in calls:
            call.cancel()
    wait_until(lambda: _read_unless_busy(client, mid), 30, "the cancelled reads' slots back")
    assert client.get_memory(mid) == blob


def test_grpc_list_memories_runs_off_the_event_loop(
    grpc_memories: tuple[InProcessServer, CacheClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, client = grpc_memories
    assert server.memories is not None
    store = server.memories
    entered, release = threading.Event(), threading.Event()
    real_list = store.list

    def slow_list(tenant: str) -> list[object]:
        entered.set()
        assert release.wait(30)
        return real_list(tenant)  # type: ignore[return-value]

    monkeypatch.setattr(store, "list", slow_list)
    lister = threading.Thread(target=client.list_memories)
    lister.start()
    try:
        assert entered.wait(30)
        # another call is answered while the list is stuck (on the loop it would wait)
        with grpc.insecure_channel(f"unix:{server.socket}") as channel:
            request = pb.GetMemoryRequest(memory_id="0f8fad5b-d9cb-469f-a165-70867728950e")
            call = pb_grpc.MemoryServiceStub(channel).GetMemory(request, timeout=10)
            assert [p.header.found for p in call] == [False]
    finally:
        release.set()
        lister.join(30)


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        (b'{"t": [' + b"9" * 5000 + b"]}", "integer of 5000 digits"),
        (b'{"t": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ],
)
def test_grpc_hostile_headers_are_invalid_argument(
    grpc_memories: tuple[InProcessServer, CacheClient], header: bytes, fragment: str
) -> None:
    _, client = grpc_memories
    with pytest.raises(errors.BadMemory, match=fragment):
        client.put_memory(struct.pack("<Q", len(header)) + header)
    assert client.list_memories() == []


def test_rest_a_header_over_the_limit_is_refused_before_the_body_is_sent(on_disk: App) -> None:
    """The 8-byte prefix alone is enough: the answer comes while the body is still unsent."""
    url = httpx.URL(str(on_disk.client.base_url))
    prefix = struct.pack("<Q", 8 << 20)  # an 8 MiB header: over the 1 MiB limit
    head = (
        f"POST /v1/memories HTTP/1.1\r\nHost: {url.host}\r\nContent-Length: {64 << 20}\r\n"
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    with socket.create_connection((url.host, url.port), timeout=20) as sock:
        sock.sendall(head + prefix + b"{" * 1024)  # and nothing more
        answer = b""
        while b"bad_memory" not in answer and (more := sock.recv(65536)):
            answer += more
    text = answer.decode(errors="replace")
    assert text.startswith("HTTP/1.1 400"), text
    assert "bad_memory" in text and "limit 1048576" in text


def test_grpc_a_header_over_the_limit_is_refused_before_the_blob_is_sent(
    grpc_memories: tuple[InProcessServer, CacheClient],
) -> None:
    server, _ = grpc_memories
    done = threading.Event()

    def parts() -> Iterator[pb.MemoryPart]:
        yield pb.MemoryPart(header=pb.MemoryHeader(length=64 << 20))
        yield pb.MemoryPart(data=struct.pack("<Q", 8 << 20) + b"{" * 1024)
        done.wait(30)  # the rest never comes while the call is open

    with grpc.insecure_channel(f"unix:{server.socket}", options=channel_options()) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)
        try:
            with pytest.raises(grpc.RpcError) as info:
                stub.PutMemory(parts(), timeout=20)
        finally:
            done.set()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "limit 1048576" in info.value.details()

"""Bounds on what one client can make the server hold or do, and how errors leave the server.

gRPC limits run against a real server process (configured through its environment); the
REST ones and the internal-error path run an in-process server on a real socket.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import httpx
import pytest

from lmcache_svc import errors
from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.client import CacheClient
from lmcache_svc.keys import MAX_FIELD_VALUE, Namespace, chunk_hashes
from lmcache_svc.server.grpc.cache_service import build_grpc_server
from lmcache_svc.server.http.api import create_app, make_uvicorn_server
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.cpu import CpuTier
from lmcache_svc.v1 import cache_pb2 as pb
from lmcache_svc.v1 import cache_pb2_grpc as pb_grpc
from lmcache_svc.wire import namespace_to_pb
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.helpers import make_namespace

MAX_NAMESPACES = 3
MAX_CHUNKS = 4


def huge_namespace_pb(**changes: int) -> pb.Namespace:
    """A namespace message whose every integer is at the top of its uint32 range."""
    msg = pb.Namespace(
        model="m",
        layout=pb.KVLayout(dtype="float32", num_layers=MAX_FIELD_VALUE,
                           num_kv_heads=MAX_FIELD_VALUE, head_size=MAX_FIELD_VALUE,
                           block_size=16, page_layout="test", kv_planes=2),
        chunk_size=MAX_FIELD_VALUE, tp_rank=0, tp_size=1, tenant="default", key_version=1,
    )  # fmt: skip
    for field, value in changes.items():
        setattr(msg.layout if hasattr(msg.layout, field) else msg, field, value)
    return msg


# -- gRPC, real server process ------------------------------------------------------------------


@pytest.fixture
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    env = {
        "LMCACHE_SVC_CACHE__MAX_NAMESPACES": str(MAX_NAMESPACES),
        "LMCACHE_SVC_CACHE__MAX_CHUNKS_PER_REQUEST": str(MAX_CHUNKS),
        "LMCACHE_SVC_MAX_BODY_BYTES": "1MiB",
    }
    proc = start_server(tmp_path_factory.mktemp("limits"), env=env)
    yield proc
    proc.cleanup()


def rpc_error(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_namespaces_are_bounded_and_known_ones_still_register(server: ServerProc) -> None:
    stub = pb_grpc.CacheServiceStub(grpc.insecure_channel(server.grpc))
    with CacheClient(server.grpc, use_shm=False) as c:
        known = [make_namespace(model=f"model-{i}") for i in range(MAX_NAMESPACES)]
        ids = [c.register_namespace(ns) for ns in known]
        with pytest.raises(errors.TooManyNamespaces, match="cache.max_namespaces"):
            c.register_namespace(make_namespace(model="one-too-many"))
        request = pb.RegisterNamespaceRequest(namespace=namespace_to_pb(make_namespace(model="x")))
        err = rpc_error(lambda: stub.RegisterNamespace(request, timeout=10))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert [c.register_namespace(ns) for ns in known] == ids  # re-registering works
        h = chunk_hashes(known[0], range(16))
        assert c.store(ids[0], h, [b"\1" * known[0].chunk_bytes]) == 1
        assert c.stats()["num_namespaces"] == MAX_NAMESPACES


def test_get_of_too_many_hashes_is_refused_before_any_work(server: ServerProc) -> None:
    ns = make_namespace(model="get-limit")
    with CacheClient(server.grpc, use_shm=False) as c:
        ns_id = c.register_namespace(ns)
        hashes = chunk_hashes(ns, range(16 * (MAX_CHUNKS + 1)))
        with pytest.raises(errors.PayloadTooLarge, match=f"limit is {MAX_CHUNKS}"):
            c.get(ns_id, hashes)
        with pytest.raises(errors.PayloadTooLarge):
            c.get(ns_id, [b"\0" * 32] * 100_000)
        assert c.get(ns_id, hashes[:MAX_CHUNKS]) == [None] * MAX_CHUNKS
    stub = pb_grpc.CacheServiceStub(grpc.insecure_channel(server.grpc))
    request = pb.GetRequest(namespace_id=ns_id, chunk_hashes=hashes)
    err = rpc_error(lambda: list(stub.Get(request, timeout=10)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("namespace", "fragment"),
    [
        (huge_namespace_pb(), "chunk_bytes"),
        (huge_namespace_pb(chunk_size=1, num_layers=1, num_kv_heads=1, head_size=1 << 20),
         "max_body_bytes"),  # 8 MiB chunks, over this server's 1 MiB
        (huge_namespace_pb(chunk_size=0), "chunk_size must be a positive integer"),
    ],
)  # fmt: skip
def test_oversized_namespaces_are_invalid_argument_naming_the_field(
    server: ServerProc, namespace: pb.Namespace, fragment: str
) -> None:
    stub = pb_grpc.CacheServiceStub(grpc.insecure_channel(server.grpc))
    request = pb.RegisterNamespaceRequest(namespace=namespace)
    err = rpc_error(lambda: stub.RegisterNamespace(request, timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert fragment in err.details()
    assert "Traceback" not in err.details()


# -- the namespace's own checks ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"chunk_size": MAX_FIELD_VALUE + 1}, "chunk_size must be at most 4294967295"),
        ({"tp_size": 2**64}, "tp_size must be at most"),
        ({"tp_rank": -1}, "tp_rank must be an integer >= 0"),
        ({"layout": {"num_layers": 10**40}}, "layout.num_layers must be at most"),
        ({"layout": {"head_size": True}}, "layout.head_size must be a positive integer"),
        ({"layout": {"kv_planes": True}}, "kv_planes must be 1 or 2"),
        ({"chunk_size": 1 << 20, "layout": {"num_layers": 4096}}, "over the limit of"),
    ],
)
def test_namespace_fields_are_bounded(changes: dict[str, Any], fragment: str) -> None:
    data = make_namespace().to_dict()
    data["layout"].update(changes.pop("layout", {}))
    data.update(changes)
    with pytest.raises(errors.InvalidArgument, match=fragment):
        Namespace.from_dict(data)


# -- REST, in-process server on a real socket ---------------------------------------------------


@pytest.fixture
def rest() -> Iterator[httpx.Client]:
    arena = Arena.create(1 << 20, slab_bytes=16 * 1024, prefault="off")
    settings = CacheSettings(max_namespaces=MAX_NAMESPACES, max_chunk_bytes=64 * 1024)
    cache = TieredCache(CpuTier(arena), settings=settings)
    server = make_uvicorn_server(create_app(cache, max_body_bytes=64 * 1024), "127.0.0.1", 0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "uvicorn did not start"
        thread.join(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        yield client
    server.should_exit = True
    thread.join(timeout=10)
    cache.close()


def test_rest_refuses_a_namespace_of_1e48_byte_chunks(rest: httpx.Client) -> None:
    data = make_namespace().to_dict()
    top = MAX_FIELD_VALUE  # every field in range, their product is not: about 1.46e48 bytes
    data.update(chunk_size=top)
    data["layout"].update(num_layers=top, num_kv_heads=top, head_size=top, kv_planes=1)
    r = rest.post("/v1/namespaces", json=data)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == "invalid_argument"
    assert "chunk_bytes" in r.json()["message"] and "over the limit" in r.json()["message"]
    data["layout"]["num_layers"] = 10**40
    r = rest.post("/v1/namespaces", json=data)
    assert r.status_code == 400, r.text
    assert "layout.num_layers must be at most 4294967295" in r.json()["message"]
    data = make_namespace(chunk_size=1 << 10).to_dict()  # 256 KiB chunks, over 64 KiB
    r = rest.post("/v1/namespaces", json=data)
    assert r.status_code == 400 and "max_body_bytes (65536)" in r.json()["message"], r.text
    assert rest.get("/v1/stats").json()["num_namespaces"] == 0


def test_rest_namespace_limit_is_507_and_known_ones_register(rest: httpx.Client) -> None:
    ids = []
    for i in range(MAX_NAMESPACES):
        r = rest.post("/v1/namespaces", json=make_namespace(model=f"m{i}").to_dict())
        assert r.status_code == 200, r.text
        ids.append(r.json()["namespace_id"])
    r = rest.post("/v1/namespaces", json=make_namespace(model="extra").to_dict())
    assert r.status_code == 507, r.text
    assert r.json()["error"] == "too_many_namespaces"
    again = rest.post("/v1/namespaces", json=make_namespace(model="m0").to_dict())
    assert again.status_code == 200 and again.json()["namespace_id"] == ids[0]


def test_openapi_documents_the_namespace_bounds(rest: httpx.Client) -> None:
    schemas = rest.get("/openapi.json").json()["components"]["schemas"]
    chunk_size = schemas["NamespaceModel"]["properties"]["chunk_size"]
    assert (chunk_size["minimum"], chunk_size["maximum"]) == (1, MAX_FIELD_VALUE)
    assert schemas["KVLayoutModel"]["properties"]["num_layers"]["maximum"] == MAX_FIELD_VALUE
    responses = rest.get("/openapi.json").json()["paths"]["/v1/namespaces"]["post"]["responses"]
    assert {"400", "507"} <= set(responses)


# -- unexpected exceptions over gRPC ----------------------------------------------------------


class _InProcessGrpc:
    """``build_grpc_server`` on a free loopback port, its event loop in a thread."""

    def __init__(self, cache: TieredCache) -> None:
        self.cache = cache
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.server, self.port = self._call(self._start())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _start(self) -> tuple[grpc.aio.Server, int]:
        server, _, _ = build_grpc_server(
            self.cache, max_body_bytes=1 << 20, workers=2, auth_token=None
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def stop(self) -> None:
        self._call(self.server.stop(None))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self.cache.close()


@pytest.fixture
def grpc_in_process() -> Iterator[_InProcessGrpc]:
    arena = Arena.create(1 << 20, slab_bytes=16 * 1024, prefault="off")
    served = _InProcessGrpc(TieredCache(CpuTier(arena)))
    yield served
    served.stop()


def _broken(*args: object, **kwargs: object) -> Any:
    raise RuntimeError("secret internals at 0xdeadbeef")


@pytest.mark.parametrize("method", ["Stats", "Get", "OpenSession"])
def test_an_unexpected_exception_is_internal_with_a_generic_message(
    grpc_in_process: _InProcessGrpc,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    method: str,
) -> None:
    cache = grpc_in_process.cache
    ns = cache.register_namespace(make_namespace())
    broken = {"Stats": "stats", "Get": "get", "OpenSession": "open_session"}[method]
    monkeypatch.setattr(cache, broken, _broken)
    stub = pb_grpc.CacheServiceStub(grpc.insecure_channel(f"127.0.0.1:{grpc_in_process.port}"))
    calls: dict[str, Callable[[], Any]] = {
        "Stats": lambda: stub.Stats(pb.StatsRequest(), timeout=10),
        "Get": lambda: list(stub.Get(
            pb.GetRequest(namespace_id=ns.namespace_id, chunk_hashes=[b"\1" * 32]), timeout=10
        )),
        "OpenSession": lambda: next(iter(stub.OpenSession(pb.OpenSessionRequest(), timeout=10))),
    }  # fmt: skip
    with caplog.at_level(logging.ERROR, logger="lmcache_svc.server.grpc.calls"):
        err = rpc_error(calls[method])
    assert err.code() == grpc.StatusCode.INTERNAL, err.details()
    assert "secret" not in err.details() and "Traceback" not in err.details()
    assert f"internal error in {method}" in err.details()
    assert dict(err.trailing_metadata() or ())["lmcache-error-kind"] == "internal"
    assert any("secret internals" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)
    errors_counted = cache.metrics.errors.labels(kind="internal")._value.get()
    assert errors_counted == 1
    monkeypatch.undo()
    assert stub.Stats(pb.StatsRequest(), timeout=10).num_namespaces == 1  # still serving


def test_settings_reach_the_cache_from_the_config() -> None:
    from lmcache_svc.config import load_config
    from lmcache_svc.server.app import build_cache

    env = {
        "LMCACHE_SVC_CACHE__MAX_NAMESPACES": "7",
        "LMCACHE_SVC_MAX_BODY_BYTES": "2MiB",
        "LMCACHE_SVC_CACHE__MAINTENANCE_INTERVAL_S": "0.25",
    }
    config = load_config(env=env, overrides={"cpu.capacity": "4MiB", "cpu.prefault": "off"})
    cache = build_cache(config)
    try:
        assert cache.settings.max_namespaces == 7
        assert cache.settings.max_chunk_bytes == 2 << 20
        assert cache.settings.maintenance_interval_s == 0.25
    finally:
        cache.close()

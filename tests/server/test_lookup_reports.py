"""Lookups a client answers from the shared-memory index reach the server's lookup counters
through ``ReportLookups``: exactly what the same lookups over gRPC would have counted, a
little later; reports that cannot be true, or name another tenant's namespace, are refused."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.client import CacheClient
from lmcache_svc.client.lookup_reports import REPORT_TIMEOUT_S
from lmcache_svc.server.lookup_reports import (
    CHUNKS_PER_S,
    LOOKUPS_PER_S,
    MAX_REPORTED_CHUNKS,
    MAX_REPORTED_LOOKUPS,
)
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.cpu import CpuTier
from lmcache_svc.v1 import cache_pb2 as pb
from lmcache_svc.v1 import cache_pb2_grpc as pb_grpc
from tests.helpers import count_calls, wait_until
from tests.server.test_lookup_index import (
    ACME,
    ACME_NS,
    ACME_READER,
    CHUNK,
    GLOBEX,
    GLOBEX_NS,
    Served,
    h,
    make_cache,
    put_acme,
)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    srv = Served(make_cache(4), tmp_path)
    yield srv
    srv.close()


COUNTERS = {
    "index_lookups": ("lmcache_svc_index_lookups_total", {}),
    "lookup_chunks": ("lmcache_svc_lookup_chunks_total", {}),
    "lookup_hit_chunks": ("lmcache_svc_lookup_hit_chunks_total", {}),
    "chunk_misses": ("lmcache_svc_chunk_misses_total", {}),
    "cpu_hits": ("lmcache_svc_chunk_hits_total", {"tier": "cpu"}),
    "lookup_rpcs": (
        "lmcache_svc_requests_total",
        {"transport": "grpc", "method": "Lookup", "code": "OK"},
    ),
}


def counters(cache: TieredCache) -> dict[str, float]:
    registry = cache.metrics.registry
    return {
        key: registry.get_sample_value(name, labels) or 0.0
        for key, (name, labels) in COUNTERS.items()
    }


def moved(cache: TieredCache, since: dict[str, float]) -> dict[str, float]:
    now = counters(cache)
    return {key: now[key] - since[key] for key in now}


QUERIES = [[h(0), h(1), h(2), h(9), h(1)], [h(9)], [h(1), h(2)], []]


def test_index_answered_lookups_count_as_grpc_lookups_would(served: Served) -> None:
    cache = served.cache
    put_acme(cache, 3)
    with (
        served.client(ACME, report_interval_s=3600) as local,
        served.client(ACME, local_lookup=False) as remote,
    ):
        ns_id = local.register_namespace(ACME_NS)
        remote.register_namespace(ACME_NS)
        assert local.shm_available
        before = counters(cache)
        answers = [remote.lookup(ns_id, q) for q in QUERIES]
        via_grpc = moved(cache, before)
        before = counters(cache)
        assert [local.lookup(ns_id, q) for q in QUERIES] == answers
        assert moved(cache, before) == dict.fromkeys(COUNTERS, 0.0)  # not reported yet
        assert local.flush_lookup_reports() == len(QUERIES)
        via_index = moved(cache, before)
        assert local.flush_lookup_reports() == 0  # nothing new: no call
    assert via_grpc == {
        "index_lookups": 0.0,
        "lookup_chunks": 8.0,
        "lookup_hit_chunks": 5.0,
        "chunk_misses": 3.0,
        "cpu_hits": 5.0,
        "lookup_rpcs": 4.0,
    }
    assert via_index == {**via_grpc, "index_lookups": 4.0, "lookup_rpcs": 0.0}


def test_close_reports_the_rest_and_the_interval_bounds_the_delay(served: Served) -> None:
    cache = served.cache
    cache.put(ACME_NS.namespace_id, h(0), b"\0" * CHUNK)
    before = counters(cache)
    with served.client(ACME, report_interval_s=3600) as client:
        ns_id = client.register_namespace(ACME_NS)
        assert client.shm_available
        assert client.lookup(ns_id, [h(0), h(1)]).num_hit_chunks == 1
    assert moved(cache, before)["lookup_chunks"] == 2.0  # sent by close()
    before = counters(cache)
    with served.client(ACME, report_interval_s=0.2) as client:
        ns_id = client.register_namespace(ACME_NS)
        assert client.shm_available
        client.lookup(ns_id, [h(0)])
        # the reporting thread sends it while the client is open (well before the bound)
        wait_until(lambda: moved(cache, before)["index_lookups"] > 0, 5, "the lookup reported")
        assert moved(cache, before)["index_lookups"] == 1.0


def _report_as(served: Served, token: str | None) -> Callable[..., pb.ReportLookupsResponse]:
    channel = grpc.insecure_channel(served.socket)
    stub = pb_grpc.CacheServiceStub(channel)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def report(**fields: Any) -> pb.ReportLookupsResponse:
        fields.setdefault("namespace_id", ACME_NS.namespace_id)
        request = pb.ReportLookupsRequest(**fields)
        return stub.ReportLookups(request, timeout=10, metadata=metadata)

    return report


REFUSED = [
    ({"num_lookups": -1}, "num_lookups is -1"),
    ({"num_lookups": 1, "num_chunks": 2, "num_hit_chunks": -5}, "num_hit_chunks is -5"),
    ({"num_lookups": 1, "num_chunks": 2, "num_hit_chunks": 3}, "num_hit_chunks 3 is more"),
    ({"num_lookups": 1, "num_chunks": 8193}, "max_chunks_per_request (8192)"),
    ({"num_lookups": 2, "num_chunks": 2**63 - 1}, "max_chunks_per_request"),
    ({"num_lookups": MAX_REPORTED_LOOKUPS + 1}, f"is over {MAX_REPORTED_LOOKUPS}"),
]


@pytest.mark.parametrize(("fields", "why"), REFUSED)
def test_reports_that_cannot_be_true_are_refused(
    served: Served, fields: dict[str, int], why: str
) -> None:
    cache = served.cache
    report = _report_as(served, ACME)
    before = counters(cache)
    with pytest.raises(grpc.RpcError) as info:
        report(**fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert why in info.value.details()
    assert moved(cache, before) == dict.fromkeys(COUNTERS, 0.0)
    assert cache.metrics.registry.get_sample_value(
        "lmcache_svc_errors_total", {"kind": "invalid_argument"}
    )
    report(num_lookups=2, num_chunks=3, num_hit_chunks=1)  # still serving; a true report counts
    assert moved(cache, before) == {
        "index_lookups": 2.0,
        "lookup_chunks": 3.0,
        "lookup_hit_chunks": 1.0,
        "chunk_misses": 2.0,
        "cpu_hits": 1.0,
        "lookup_rpcs": 0.0,
    }


def test_a_report_is_for_the_caller_s_own_tenant(served: Served) -> None:
    cache = served.cache
    before = counters(cache)
    with pytest.raises(grpc.RpcError) as info:  # acme's token, globex's namespace
        _report_as(served, ACME)(namespace_id=GLOBEX_NS.namespace_id, num_lookups=1)
    assert "is not registered" in info.value.details()  # as if it did not exist
    with pytest.raises(grpc.RpcError) as info:
        _report_as(served, None)(num_lookups=1)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert moved(cache, before) == dict.fromkeys(COUNTERS, 0.0)


def test_a_server_without_a_lookup_index_refuses_reports(tmp_path: Path) -> None:
    arena = Arena.create(4 * CHUNK, slab_bytes=CHUNK, prefault="off")
    cache = TieredCache(CpuTier(arena), [], settings=CacheSettings(checksums=False))
    cache.register_namespace(ACME_NS)
    srv = Served(cache, tmp_path)
    try:
        with pytest.raises(grpc.RpcError) as info:
            _report_as(srv, ACME)(num_lookups=1, num_chunks=1)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no lookup index" in info.value.details()
        assert counters(cache)["lookup_chunks"] == 0.0
    finally:
        srv.close()


def test_close_is_quick_when_the_server_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last report fails (the counts are lost with the server's own counters); close
    neither raises nor retries it: one call, under a report's deadline."""
    srv = Served(make_cache(4), tmp_path)
    srv.cache.put(ACME_NS.namespace_id, h(0), b"\0" * CHUNK)
    client = srv.client(ACME, report_interval_s=3600)
    ns_id = client.register_namespace(ACME_NS)
    assert client.shm_available
    assert client.lookup(ns_id, [h(0)]).num_hit_chunks == 1  # from the index: not reported yet
    srv.close()
    calls = count_calls(monkeypatch, CacheClient, "_call")
    client.close()
    sent = [(rpc, timeout_s) for rpc, _, timeout_s in calls]
    assert sent == [(client._stub.ReportLookups, REPORT_TIMEOUT_S)]


def refused(cache: TieredCache, reason: str) -> float:
    value = cache.metrics.registry.get_sample_value(
        "lmcache_svc_lookup_reports_refused_total", {"reason": reason}
    )
    return value or 0.0


def test_read_only_tokens_may_not_report(served: Served) -> None:
    before = counters(served.cache)
    with pytest.raises(grpc.RpcError) as info:
        _report_as(served, ACME_READER)(num_lookups=1, num_chunks=1)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "read-only" in info.value.details()
    assert moved(served.cache, before) == dict.fromkeys(COUNTERS, 0.0)
    with served.client(ACME_READER, report_interval_s=3600) as reader:  # its own lookups
        ns_id = reader.register_namespace(ACME_NS)
        assert reader.shm_available  # its session maps acme's index table
        assert reader.lookup(ns_id, [h(0)]).num_hit_chunks == 0  # answered from the index
        assert reader.flush_lookup_reports() == 0  # refused, dropped: nothing counted
    with served.client(ACME, report_interval_s=3600) as writer:  # the plugin's own reports
        ns_id = writer.register_namespace(ACME_NS)
        assert writer.shm_available
        assert writer.lookup(ns_id, [h(0)]).num_hit_chunks == 0
        assert writer.flush_lookup_reports() == 1
    assert moved(served.cache, before)["index_lookups"] == 1.0


def test_reports_are_bounded_per_tenant_and_per_interval(served: Served) -> None:
    """3,000 reports of 2^30 lookups once pushed the counters past 2^53, where adding one
    no longer moves a float; a tenant now reports at most LOOKUPS_PER_S lookups and
    CHUNKS_PER_S chunks a second (a minute's worth at once), and a report over that is
    refused by name and counted."""
    cache = served.cache
    acme, globex = _report_as(served, ACME), _report_as(served, GLOBEX)
    before = counters(cache)
    with pytest.raises(grpc.RpcError) as info:
        acme(num_lookups=1 << 30, num_chunks=1 << 30)
    assert f"is over {MAX_REPORTED_LOOKUPS}" in info.value.details()
    acme(num_lookups=MAX_REPORTED_LOOKUPS, num_chunks=MAX_REPORTED_CHUNKS)  # a full minute
    for _ in range(20):  # the budget is spent: each refused, naming it, and counted
        with pytest.raises(grpc.RpcError) as info:
            acme(num_lookups=LOOKUPS_PER_S, num_chunks=1)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{LOOKUPS_PER_S} lookups a second" in info.value.details()
    globex_ns = GLOBEX_NS.namespace_id  # another tenant's budget is its own
    with pytest.raises(grpc.RpcError) as info:  # and it bounds chunks too
        globex(namespace_id=globex_ns, num_lookups=1 << 17, num_chunks=MAX_REPORTED_CHUNKS + 1)
    assert f"{CHUNKS_PER_S} chunks a second" in info.value.details()
    assert refused(cache, "over_budget") == 21 and refused(cache, "implausible") == 1
    globex(namespace_id=globex_ns, num_lookups=LOOKUPS_PER_S, num_chunks=LOOKUPS_PER_S)
    grew = moved(cache, before)
    assert grew["index_lookups"] <= MAX_REPORTED_LOOKUPS + LOOKUPS_PER_S * 1.01
    assert grew["lookup_chunks"] <= MAX_REPORTED_CHUNKS + LOOKUPS_PER_S * 1.01

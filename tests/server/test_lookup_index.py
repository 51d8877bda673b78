"""The shared-memory lookup index end to end: the cache publishes first-tier chunks as they
become readable and unpublishes them as they go; a session maps only its tenant's table;
``CacheClient.lookup`` answers from it exactly what the gRPC ``Lookup`` answers."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import platform
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.cache.values import TierPolicy
from lmcache_svc.client import CacheClient
from lmcache_svc.config import load_config
from lmcache_svc.keys import KVLayout, Namespace
from lmcache_svc.results import Placement
from lmcache_svc.server.grpc.cache_service import build_grpc_server
from lmcache_svc.server.index_publisher import IndexPublisher, lookup_index
from lmcache_svc.server.tokens import Authenticator
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.cpu import CpuTier
from lmcache_svc.tiers.ssd import SsdTier
from tests.helpers import address_of, put_chunks

LAYOUT = KVLayout(
    "uint8", num_layers=1, num_kv_heads=1, head_size=128, block_size=16, page_layout="test"
)
ACME_NS = Namespace(model="m", layout=LAYOUT, chunk_size=256, tenant="acme")
GLOBEX_NS = Namespace(model="m", layout=LAYOUT, chunk_size=256, tenant="globex")
CHUNK = ACME_NS.chunk_bytes
ACME, GLOBEX, ADMIN = "acme-token-00000001", "globex-token-000001", "ops-token-000000001"
ACME_READER = "acme-reader-0000001"
TOKENS = f"""
tokens:
  - tenant: acme
    token: {ACME}
  - tenant: acme
    token: {ACME_READER}
    read_only: true
  - tenant: globex
    token: {GLOBEX}
  - admin: true
    token: {ADMIN}
"""


def h(i: int) -> bytes:
    return hashlib.sha256(f"chunk-{i}".encode()).digest()


def put_acme(cache: TieredCache, n: int) -> list[bytes]:
    """Chunks h(0) .. h(n - 1) stored under ACME_NS, chunk i filled with byte i."""
    return put_chunks(cache, ACME_NS, [h(i) for i in range(n)])


def make_cache(
    num_chunks: int, lower: list[tuple[SsdTier, TierPolicy]] | None = None, register: bool = True
) -> TieredCache:
    arena = Arena.create(num_chunks * CHUNK, slab_bytes=CHUNK, prefault="off")
    first = CpuTier(arena)
    cache = TieredCache(
        first,
        lower or [],
        settings=CacheSettings(high_watermark=1.0, checksums=False),
        lookup_index=IndexPublisher(first.name, first.medium, num_slots=64),
    )
    if register:
        cache.register_namespace(ACME_NS)
        cache.register_namespace(GLOBEX_NS)
    return cache


def table(cache: TieredCache, tenant: str) -> object:
    assert cache.lookup_index is not None
    seg = cache.lookup_index.table_of(tenant)
    assert seg is not None
    return seg.table


class Served:
    """``cache`` behind a real gRPC server with per-tenant tokens, its loop in a thread."""

    def __init__(self, cache: TieredCache, tmp_path: Path) -> None:
        self.cache = cache
        tokens = tmp_path / "tokens.yaml"
        tokens.write_text(TOKENS)
        self._auth = Authenticator(tokens_file=tokens)
        self.socket = f"unix:{tmp_path / 'grpc.sock'}"
        self._loop = asyncio.new_event_loop()
        self._stopped = threading.Event()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        assert started.wait(30)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve(started))

    async def _serve(self, started: threading.Event) -> None:
        server, servicer, _ = build_grpc_server(
            self.cache, max_body_bytes=64 << 20, workers=2, auth=self._auth
        )
        server.add_insecure_port(self.socket)
        await server.start()
        started.set()
        while not self._stopped.is_set():
            await asyncio.sleep(0.02)
        servicer.stop()
        await server.stop(grace=None)

    def client(self, token: str, local_lookup: bool = True, **kwargs: Any) -> CacheClient:
        return CacheClient(self.socket, auth_token=token, local_lookup=local_lookup, **kwargs)

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(30)
        self.cache.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    srv = Served(make_cache(4), tmp_path)
    yield srv
    srv.close()


def test_published_on_commit_unpublished_on_delete_and_eviction() -> None:
    cache = make_cache(2)
    try:
        acme = table(cache, "acme")
        cache.prepare_store(ACME_NS.namespace_id, [h(0)], session_id="s")
        assert not acme.contains(ACME_NS.namespace_id + h(0))  # reserved, not readable yet
        cache.commit_store(ACME_NS.namespace_id, [h(0)], session_id="s")
        assert acme.contains(ACME_NS.namespace_id + h(0))
        # only its own tenant's table
        assert not table(cache, "globex").contains(GLOBEX_NS.namespace_id + h(0))
        cache.delete(ACME_NS.namespace_id, [h(0)])
        assert not acme.contains(ACME_NS.namespace_id + h(0))
        cache.put(ACME_NS.namespace_id, h(1), b"\1" * CHUNK)
        lease = cache.prepare_load(ACME_NS.namespace_id, [h(1)])
        cache.delete(ACME_NS.namespace_id, [h(1)])  # pinned: freed later, unreadable now
        assert not acme.contains(ACME_NS.namespace_id + h(1))
        assert lease.lease_id is not None
        cache.release_load(lease.lease_id)
        for i in (2, 3, 4):  # two slots: storing a third evicts the least recent
            cache.put(ACME_NS.namespace_id, h(i), bytes([i]) * CHUNK)
        key = ACME_NS.namespace_id
        assert not acme.contains(key + h(2))
        assert acme.contains(key + h(3)) and acme.contains(key + h(4))
        assert acme.num_entries == 2
    finally:
        cache.close()


def test_client_lookup_is_local_and_matches_grpc(served: Served) -> None:
    cache = served.cache
    put_acme(cache, 3)
    query = [h(0), h(1), h(2), h(9), h(1)]
    with served.client(ACME) as local, served.client(ACME, local_lookup=False) as remote:
        ns_id = local.register_namespace(ACME_NS)
        remote.register_namespace(ACME_NS)
        assert local.shm_available  # opens the session: arena and index mapped
        before = cache.metrics.lookup_chunks._value.get()  # noqa: SLF001
        got = local.lookup(ns_id, query)
        assert cache.metrics.lookup_chunks._value.get() == before  # noqa: SLF001 (no RPC)
        assert got == remote.lookup(ns_id, query)
        assert got.num_hit_chunks == 3 and got.tiers == ["cpu"] * 3
        cache.delete(ns_id, [h(1)])
        assert local.lookup(ns_id, query).num_hit_chunks == 1
        cache.put(ACME_NS.namespace_id, h(1), b"\1" * CHUNK)
        assert local.lookup(ns_id, query).num_hit_chunks == 3


def test_reads_in_place_and_leases_say_where_each_view_starts(served: Served) -> None:
    # The plugin's copies join chunks that lie one after another by these offsets alone.
    hashes = put_acme(served.cache, 3)
    with served.client(ACME) as client:
        ns_id = client.register_namespace(ACME_NS)
        assert client.shm_available
        read = client.read_in_place(ns_id, hashes)
        lease = client.prepare_load(ns_id, hashes)
        try:
            assert read is not None and len(lease.buffers) == 3
            for buffers, offsets in ((read.buffers, read.offsets), (lease.buffers, lease.offsets)):
                assert len(offsets) == 3 and len(set(offsets)) == 3
                assert [bytes(b[:1]) for b in buffers] == [b"\0", b"\1", b"\2"]
                base = address_of(buffers[0]) - offsets[0]  # the segment's start
                assert [address_of(b) - base for b in buffers] == offsets
        finally:
            client.release_load(lease)


def test_a_placement_naming_a_page_outside_the_segment_is_not_read(served: Served) -> None:
    # A placement travels between processes; one whose location lies past the mapped
    # segment (a forged or corrupted one) gives no view of other memory: no read in place.
    hashes = put_acme(served.cache, 2)
    with served.client(ACME) as client:
        ns_id = client.register_namespace(ACME_NS)
        assert client.shm_available  # opens the session: arena and index mapped
        answer = client.lookup_local(ns_id, hashes)
        placement = None if answer is None else answer.placement
        assert placement is not None and client.read_in_place(ns_id, hashes, placement)
        far = placement.locations[1] | 0xFFFFFFFF  # the same serial, the last page there is
        forged = Placement(placement.nonce, placement.seq, (placement.locations[0], far))
        assert client.read_in_place(ns_id, hashes, forged) is None


def test_a_tenant_session_maps_only_its_own_table(served: Served) -> None:
    cache = served.cache
    cache.put(GLOBEX_NS.namespace_id, h(0), b"\0" * CHUNK)
    with served.client(ACME) as acme, served.client(GLOBEX) as globex:
        acme.register_namespace(ACME_NS)
        globex.register_namespace(GLOBEX_NS)
        assert acme.shm_available and globex.shm_available
        acme_session = acme._live_session()  # noqa: SLF001
        assert set(acme_session.indexes) == {"acme"}
        assert set(globex._live_session().indexes) == {"globex"}  # noqa: SLF001
        # acme's table never holds globex's chunk, whatever hash acme asks about
        acme_index = acme_session.indexes["acme"]
        assert acme_index.lookup(GLOBEX_NS.namespace_id, [h(0)]).num_hit_chunks == 0  # type: ignore[union-attr]
        assert globex.lookup(GLOBEX_NS.namespace_id, [h(0)]).num_hit_chunks == 1
    with served.client(ADMIN) as admin:
        admin.register_namespace(ACME_NS)
        assert admin.shm_available
        assert set(admin._live_session().indexes) == {"acme", "globex", "default"}  # noqa: SLF001


def test_chunks_in_a_lower_tier_are_hits_through_the_fallback(tmp_path: Path) -> None:
    ssd = SsdTier(tmp_path / "ssd", 16 * CHUNK)
    srv = Served(make_cache(1, [(ssd, TierPolicy(accept_demotions=True))]), tmp_path)
    try:
        cache = srv.cache
        cache.put(ACME_NS.namespace_id, h(0), b"\0" * CHUNK)
        cache.put(ACME_NS.namespace_id, h(1), b"\1" * CHUNK)  # demotes h(0) to the SSD
        assert not table(cache, "acme").contains(ACME_NS.namespace_id + h(0))
        with srv.client(ACME) as client:
            ns_id = client.register_namespace(ACME_NS)
            assert client.shm_available
            got = client.lookup(ns_id, [h(0), h(1)])
            assert got.num_hit_chunks == 2 and got.tiers == ["ssd", "cpu"]
            assert client.lookup(ns_id, [h(1)]).tiers == ["cpu"]  # a full hit: local
    finally:
        srv.close()


def test_a_session_opened_before_any_registration_gets_its_table(tmp_path: Path) -> None:
    """The plugin registers first, but any client may open its session first."""
    srv = Served(make_cache(2, register=False), tmp_path)
    try:
        with srv.client(ACME) as client:
            assert client.shm_available  # no acme namespace is known yet
            ns_id = client.register_namespace(ACME_NS)
            srv.cache.put(ACME_NS.namespace_id, h(5), b"\5" * CHUNK)
            before = srv.cache.metrics.lookup_chunks._value.get()  # noqa: SLF001
            assert client.lookup(ns_id, [h(5)]).num_hit_chunks == 1
            assert srv.cache.metrics.lookup_chunks._value.get() == before  # noqa: SLF001
    finally:
        srv.close()


ACME_NS2 = Namespace(model="m2", layout=LAYOUT, chunk_size=256, tenant="acme")


def test_the_index_is_keyed_by_namespace_and_chunk_hash(served: Served) -> None:
    """The same chunk hash in two namespaces of one tenant is two entries: a chunk of one
    namespace is never a local hit in the other, and a delete in one leaves the other."""
    cache = served.cache
    cache.register_namespace(ACME_NS2)
    ns1, ns2 = ACME_NS.namespace_id, ACME_NS2.namespace_id
    cache.put(ns1, h(0), b"\0" * CHUNK)
    with served.client(ACME) as client:
        client.register_namespace(ACME_NS)
        client.register_namespace(ACME_NS2)
        assert client.shm_available
        assert client.lookup(ns1, [h(0)]).num_hit_chunks == 1
        assert client.lookup(ns2, [h(0)]).num_hit_chunks == 0  # not stored in ns2
        cache.put(ns2, h(0), b"\2" * CHUNK)
        assert client.lookup(ns2, [h(0)]).num_hit_chunks == 1
        cache.delete(ns1, [h(0)])
        assert client.lookup(ns1, [h(0)]).num_hit_chunks == 0  # deleted there
        assert client.lookup(ns2, [h(0)]).num_hit_chunks == 1  # and still here
        cache.delete(ns2, [h(0)])
        cache.put(ns1, h(0), b"\0" * CHUNK)
        assert client.lookup(ns2, [h(0)]).num_hit_chunks == 0
        assert client.lookup(ns1, [h(0)]).num_hit_chunks == 1


def test_every_write_to_a_table_holds_the_publisher_s_lock() -> None:
    """One writer: ``changed`` (called under the cache's lock) writes under the publisher's
    lock too, as its heartbeat and its other methods do."""
    cache = make_cache(2)
    publisher = cache.lookup_index
    assert publisher is not None
    acme = table(cache, "acme")
    writes: list[str] = []

    def held(name: str) -> None:
        real = getattr(acme, name)

        def write(*args: Any) -> Any:
            assert publisher._lock.locked(), f"{name} without the publisher's lock"  # noqa: SLF001
            writes.append(name)
            return real(*args)

        setattr(acme, name, write)

    for name in ("insert", "remove", "set_lower_tiers", "mark_closed"):
        held(name)
    try:
        cache.put(ACME_NS.namespace_id, h(0), b"\0" * CHUNK)
        cache.delete(ACME_NS.namespace_id, [h(0)])
        publisher.set_lower_tiers(False)
    finally:
        cache.close()
    assert writes == ["insert", "remove", "set_lower_tiers", "mark_closed"]


def test_off_x86_the_client_maps_no_table_and_lookups_go_over_grpc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The index's lock-free reads rely on x86-64's memory ordering: on another CPU a client
    offered a table (here by a publisher made directly) does not map it, says why once, and
    every lookup is a ``Lookup`` call with the same answers."""
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    srv = Served(make_cache(4), tmp_path)
    try:
        cache = srv.cache
        put_acme(cache, 3)
        with srv.client(ACME) as client, caplog.at_level(logging.WARNING):
            ns_id = client.register_namespace(ACME_NS)
            assert client.shm_available  # the arena is mapped, the index is not
            assert client._live_session().indexes == {}  # noqa: SLF001
            query = [h(0), h(1), h(2), h(9)]
            before = cache.metrics.lookup_chunks._value.get()  # noqa: SLF001
            got = client.lookup(ns_id, query)
            assert cache.metrics.lookup_chunks._value.get() == before + 4  # noqa: SLF001 (RPC)
            assert got.num_hit_chunks == 3 and got.tiers == ["cpu"] * 3
            cache.delete(ns_id, [h(1)])
            assert client.lookup(ns_id, query).num_hit_chunks == 1
        refusals = [r.getMessage() for r in caplog.records if "lookup index" in r.getMessage()]
        assert len(refusals) == 1 and "'aarch64', not x86-64" in refusals[0]
    finally:
        srv.close()


def test_off_x86_the_server_publishes_no_index(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = load_config(env={})
    publisher = lookup_index(config, "cpu", "host_memory")
    assert publisher is not None  # on x86-64, as configured
    publisher.close()
    monkeypatch.setattr(platform, "machine", lambda: "ppc64le")
    with caplog.at_level(logging.WARNING):
        assert lookup_index(config, "cpu", "host_memory") is None
    assert "'ppc64le', not x86-64" in caplog.text and "clients use Lookup" in caplog.text

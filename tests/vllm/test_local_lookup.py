"""The scheduler's lookup through the server's shared-memory index, against a real server.

A hit comes from the index without a Lookup call; a chunk that goes between the lookup and
the load (eviction, delete) fails that load's blocks, and the scheduler learns the shorter
hit (the engine recomputes those tokens: vLLM's ``recompute`` load-failure policy, set by
the plugin). Without the index (a server with it off) the same answers come over gRPC.
"""

# ruff: noqa: E402  (imports after the torch check)
from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the worker half needs torch (the [torch] extra)")
import torch
from lmcache_svc_vllm.config import ConnectorConfig
from lmcache_svc_vllm.link import ServerLink
from lmcache_svc_vllm.scheduler import SchedulerSide
from lmcache_svc_vllm.stats import StatsRecorder
from lmcache_svc_vllm.worker import WorkerSide

from lmcache_svc.client import CacheClient
from lmcache_svc.keys import chunk_hashes
from lmcache_svc.shm.index_reader import IndexReader
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.helpers import count_calls, wait_until
from tests.vllm.test_scheduler_side import (
    BLOCK,
    CHUNK,
    NAMESPACE,
    answer,
    make_scheduler,
    request,
    store_prefix,
    tokens,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    proc = start_server(tmp_path_factory.mktemp("local-lookup"))
    yield proc
    proc.cleanup()


def count_lookup_calls(scheduler: SchedulerSide, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    client = scheduler.link._client  # noqa: SLF001
    calls = [0]
    real = client._ns_call  # noqa: SLF001

    def counted(method: Any, *args: Any, **kwargs: Any) -> Any:
        if method is client._stub.Lookup:  # noqa: SLF001
            calls[0] += 1
        return real(method, *args, **kwargs)

    monkeypatch.setattr(client, "_ns_call", counted)
    return calls


def test_hit_from_the_index_then_a_chunk_evicted_before_the_load(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = tokens(31, 3 * CHUNK + 10)
    store_prefix(server, prompt, 3)
    scheduler, stats = make_scheduler(server.socket)
    worker = make_worker(server.socket)
    try:
        calls = count_lookup_calls(scheduler, monkeypatch)
        req = request("r-index", prompt)
        assert answer(scheduler, req) == (3 * CHUNK, False)
        assert calls[0] == 0, "the hit took a Lookup round trip"
        assert (stats.take() or {}).get("lookup_hit_tokens") == 3 * CHUNK

        hashes = chunk_hashes(NAMESPACE, prompt)
        with CacheClient(server.socket) as other:  # the chunk goes after the lookup
            other.delete(other.register_namespace(NAMESPACE), hashes[2:3])
        block_ids = list(range(8, 8 + 3 * CHUNK // BLOCK))
        scheduler.update_state_after_alloc(req, block_ids, 3 * CHUNK)
        plan = scheduler.build_step_plan(_no_scheduled_requests())
        worker.start_load(plan)
        failed = worker.take_load_errors()
        assert failed == set(block_ids[2 * CHUNK // BLOCK :])  # chunk 2's blocks: recomputed
        scheduler.on_invalid_blocks(failed)
        state = scheduler._requests["r-index"]  # noqa: SLF001
        assert state.num_hit_chunks == 2 and state.num_saved_chunks == 2  # saved again later
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_the_worker_reads_where_the_scheduler_s_lookup_found_the_chunks(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lookup's placement travels in the load plan: the worker copies from there with
    no second read of the index (the check after the copy still runs), and falls back to
    reading the index for a placement of another table."""
    prompt = tokens(34, 2 * CHUNK + 5)
    hashes = chunk_hashes(NAMESPACE, prompt)[:2]
    data = [random.Random(i).randbytes(NAMESPACE.chunk_bytes) for i in range(2)]
    with CacheClient(server.socket) as client:
        assert client.store(client.register_namespace(NAMESPACE), hashes, data) == 2
    scheduler, _ = make_scheduler(server.socket)
    worker = make_worker(server.socket)
    try:
        wait_until(lambda: worker.link.read_in_place(hashes), 5, "the worker's arena mapped")
        worker.stats.take()
        locates = count_calls(monkeypatch, IndexReader, "locate")
        for i, other_table in enumerate([False, True]):
            req = request(f"r-placed-{i}", prompt)
            assert answer(scheduler, req) == (2 * CHUNK, False)
            block_ids = [9, 8, 7, 6, 2, 3, 4, 5][: 2 * CHUNK // BLOCK]
            scheduler.update_state_after_alloc(req, block_ids, 2 * CHUNK)
            plan = scheduler.build_step_plan(_no_scheduled_requests())
            placement = plan.loads[0].placement
            assert placement is not None and len(placement.locations) == 2
            if other_table:  # e.g. the server restarted between the lookup and the load
                bad = dataclasses.replace(placement, nonce=bytes(16))
                plan.loads[0] = dataclasses.replace(plan.loads[0], placement=bad)
            for layer in worker._pages.layers:  # noqa: SLF001
                layer.zero_()
            worker.start_load(plan)
            assert worker.take_load_errors() == set()
            assert len(locates) == (1 if other_table else 0)
            assert (worker.stats.take() or {}).get("load_in_place_chunks") == 2
            per_chunk = CHUNK // BLOCK
            for c, chunk in enumerate(data):
                got = b"".join(
                    bytes(layer[block].numpy())
                    for layer in worker._pages.layers  # noqa: SLF001
                    for block in block_ids[c * per_chunk : (c + 1) * per_chunk]
                )
                assert got == chunk
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_without_the_index_the_lookup_goes_to_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = start_server(tmp_path, env={"LMCACHE_SVC_CPU__LOOKUP_INDEX": "false"})
    try:
        prompt = tokens(32, 2 * CHUNK + 1)
        store_prefix(srv, prompt, 2)
        scheduler, _ = make_scheduler(srv.socket)
        calls = count_lookup_calls(scheduler, monkeypatch)
        assert answer(scheduler, request("r-grpc", prompt)) == (2 * CHUNK, False)
        assert calls[0] == 1
        scheduler.shutdown()
    finally:
        srv.cleanup()


def test_a_miss_from_the_index_is_final_and_local(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler, stats = make_scheduler(server.socket)
    calls = count_lookup_calls(scheduler, monkeypatch)
    assert answer(scheduler, request("r-miss", tokens(33, 4 * CHUNK))) == (0, False)
    assert calls[0] == 0 and (stats.take() or {}).get("lookups") == 1
    scheduler.shutdown()


def make_worker(url: str) -> WorkerSide:
    """A worker half for the scheduler's namespace (2 layers, 1 head of 32, 16 blocks)."""
    config = ConnectorConfig(url=url, chunk_size=CHUNK)
    worker = WorkerSide(
        NAMESPACE,
        ServerLink(config, NAMESPACE, "test-worker"),
        StatsRecorder(),
        num_blocks=16,
        page_order="BHNC",
    )
    layers = [torch.zeros(16, 1, BLOCK, 2 * 32, dtype=torch.bfloat16) for _ in range(2)]
    worker.register_kv_caches({f"model.layers.{i}.attn": t for i, t in enumerate(layers)})
    return worker


def _no_scheduled_requests() -> Any:
    from types import SimpleNamespace

    cached = SimpleNamespace(req_ids=[], num_computed_tokens=[])
    return SimpleNamespace(
        num_scheduled_tokens={},
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        kv_connector_block_state=None,
    )

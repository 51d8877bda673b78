"""Leases started by the scheduler half for a worker in its process (``prefetch.py``):
the worker's load makes no call of its own and loads the same bytes; a lease nobody takes
is released; a worker in another process (nothing attached) leases itself as before."""

# ruff: noqa: E402  (imports after the torch check)
from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("torch", reason="the layout code needs torch (the [torch] extra)")
import torch
from lmcache_svc_vllm.config import ConnectorConfig
from lmcache_svc_vllm.link import ServerLink
from lmcache_svc_vllm.metadata import StepPlan
from lmcache_svc_vllm.prefetch import Prefetches
from lmcache_svc_vllm.scheduler import SchedulerSide
from lmcache_svc_vllm.stats import StatsRecorder
from lmcache_svc_vllm.worker import WorkerSide

from lmcache_svc.client import CacheClient
from lmcache_svc.keys import chunk_hashes
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.helpers import count_calls, wait_until
from tests.vllm.test_scheduler_side import _empty_step, answer, request
from tests.vllm.test_worker_side import BLOCK, CHUNK, HEAD_SIZE, HEADS, LAYERS, NAMESPACE

NUM_BLOCKS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    proc = start_server(tmp_path_factory.mktemp("prefetch"))
    yield proc
    proc.cleanup()


def engine(
    url: str, prefetches: Prefetches | None, read_in_place: bool = False, **settings: bool
) -> tuple[SchedulerSide, WorkerSide, list[torch.Tensor]]:
    """One engine's two halves in this process; the worker attaches to ``prefetches``.
    Loads take leases (``read_in_place`` off: a worker that reads in place leases nothing,
    so it attaches to nothing, ``test_reads_in_place_need_no_prefetch``). ``settings``:
    other config keys (``pretouch_loads``)."""
    config = ConnectorConfig(
        url=url, chunk_size=CHUNK, lookup_timeout_ms=2000, read_in_place=read_in_place, **settings
    )
    stats = StatsRecorder()
    scheduler = SchedulerSide(
        config, [NAMESPACE], BLOCK, ServerLink(config, NAMESPACE, "prefetch-scheduler"), stats,
        prefetches=prefetches if prefetches is not None else Prefetches(),
    )  # fmt: skip
    worker = WorkerSide(
        NAMESPACE,
        ServerLink(config, NAMESPACE, "prefetch-worker"),
        stats,
        num_blocks=NUM_BLOCKS,
        page_order="BHNC",
        prefetches=prefetches,
    )
    layers = [
        torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE, dtype=torch.bfloat16)
        for _ in range(LAYERS)
    ]
    worker.register_kv_caches({f"model.layers.{i}.attn": t for i, t in enumerate(layers)})
    return scheduler, worker, layers


def store(server: ServerProc, prompt: list[int], num_chunks: int) -> list[bytes]:
    hashes = chunk_hashes(NAMESPACE, prompt)[:num_chunks]
    data = [bytes([i + 1]) * NAMESPACE.chunk_bytes for i in range(num_chunks)]
    with CacheClient(server.socket) as client:
        assert client.store(client.register_namespace(NAMESPACE), hashes, data) == num_chunks
    return data


def active_leases(server: ServerProc) -> int:
    with CacheClient(server.socket) as client:
        return int(client.stats()["active_leases"])


def schedule(scheduler: SchedulerSide, req_id: str, prompt: list[int]) -> StepPlan:
    """vLLM's scheduling of a new request with a hit: the lookup, the blocks, the plan."""
    req = request(req_id, prompt)
    num_tokens, _ = answer(scheduler, req)
    assert num_tokens == 2 * CHUNK
    block_ids = list(range(2, 2 + len(prompt) // BLOCK + 1))
    scheduler.update_state_after_alloc(req, block_ids, num_tokens)
    return scheduler.build_step_plan(_empty_step())


def test_the_worker_takes_the_lease_the_scheduler_started(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefetches = Prefetches()
    scheduler, worker, layers = engine(server.socket, prefetches)
    prompt = list(range(5000, 5000 + 2 * CHUNK + 10))
    data = store(server, prompt, 2)
    leases = count_calls(monkeypatch, worker.link._client, "prepare_load")
    try:
        plan = schedule(scheduler, "r1", prompt)
        assert len(prefetches) == 1  # started with the plan, on the lookup thread
        worker.bind(plan)
        worker.start_load(plan)
        assert worker.take_load_errors() == set()
        assert len(leases) == 1, "the worker leased again"
        assert len(prefetches) == 0
        for layer in layers:  # chunk i's bytes are i + 1: every page of its blocks
            pages = layer.view(NUM_BLOCKS, -1).view(torch.uint8)
            assert bool((pages[2:4] == 1).all()) and bool((pages[4:6] == 2).all())
        assert data[0][0] == 1
        wait_until(lambda: active_leases(server) == 0, 10, "the lease released after the copy")
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_a_lease_nobody_takes_is_released(server: ServerProc) -> None:
    prefetches = Prefetches()
    scheduler, worker, _ = engine(server.socket, prefetches)
    prompt = list(range(7000, 7000 + 2 * CHUNK + 10))
    store(server, prompt, 2)
    try:
        schedule(scheduler, "gone", prompt)
        wait_until(lambda: active_leases(server) == 1, 10, "the lease started ahead")
        assert not scheduler.request_finished("gone", 0, [])  # aborted before its step ran
        assert len(prefetches) == 0
        wait_until(lambda: active_leases(server) == 0, 10, "the untaken lease released")

        plan = schedule(scheduler, "changed", prompt)
        other = list(plan.loads[0].chunk_hashes[0][:1])  # the worker loads another range
        assert prefetches.take("changed", other, 5.0) is None
        wait_until(lambda: active_leases(server) == 0, 10, "the mismatched lease released")
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_a_worker_in_another_process_leases_itself(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler, worker, layers = engine(server.socket, None)  # nothing attached
    prompt = list(range(9000, 9000 + 2 * CHUNK + 10))
    store(server, prompt, 2)
    leases = count_calls(monkeypatch, worker.link._client, "prepare_load")
    try:
        plan = schedule(scheduler, "r2", prompt)
        assert leases == []  # the scheduler started nothing
        worker.bind(plan)
        worker.start_load(plan)
        assert worker.take_load_errors() == set() and len(leases) == 1
        pages = layers[0].view(NUM_BLOCKS, -1).view(torch.uint8)
        assert bool((pages[4:6] == 2).all())
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_reads_in_place_need_no_prefetch(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that reads in place (the CPU default) does not attach: the scheduler starts
    no lease, and the worker loads without one."""
    prefetches = Prefetches()
    scheduler, worker, layers = engine(server.socket, prefetches, read_in_place=True)
    worker.link.warm_up()
    prompt = list(range(11000, 11000 + 2 * CHUNK + 10))
    store(server, prompt, 2)
    leases = count_calls(monkeypatch, CacheClient, "prepare_load")
    try:
        plan = schedule(scheduler, "r3", prompt)
        assert len(prefetches) == 0
        worker.bind(plan)
        worker.start_load(plan)
        assert worker.take_load_errors() == set() and leases == []
        pages = layers[0].view(NUM_BLOCKS, -1).view(torch.uint8)
        assert bool((pages[2:4] == 1).all()) and bool((pages[4:6] == 2).all())
    finally:
        worker.shutdown()
        scheduler.shutdown()

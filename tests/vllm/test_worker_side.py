"""The worker half's copies against a real server, over shared memory and inline gRPC.

The KV caches are CPU tensors laid out as vLLM's CPU backend lays them out ([blocks, KV
heads, tokens, K+V] per layer); plans are the plugin's own metadata types.
"""

# ruff: noqa: E402  (imports after the torch check)
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the layout code needs torch (the [torch] extra)")
import torch
from lmcache_svc_vllm import worker as worker_module
from lmcache_svc_vllm.config import ConnectorConfig
from lmcache_svc_vllm.link import ServerLink
from lmcache_svc_vllm.metadata import LoadPlan, SavePlan, StepPlan
from lmcache_svc_vllm.mover import PageMover
from lmcache_svc_vllm.stats import StatsRecorder
from lmcache_svc_vllm.worker import WorkerSide

from lmcache_svc.client import CacheClient
from lmcache_svc.errors import ServerUnavailable
from lmcache_svc.keys import KVLayout, Namespace, chunk_hashes
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.helpers import count_calls, wait_until

BLOCK, CHUNK, NUM_BLOCKS, LAYERS, HEADS, HEAD_SIZE = 128, 256, 16, 2, 1, 32
NAMESPACE = Namespace(
    model="worker-test",
    layout=KVLayout("bfloat16", LAYERS, HEADS, HEAD_SIZE, BLOCK, "vllm-cpu/BHNC"),
    chunk_size=CHUNK,
)
PROMPT = list(range(1000, 1000 + 3 * CHUNK))
HASHES = tuple(chunk_hashes(NAMESPACE, PROMPT))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    proc = start_server(tmp_path_factory.mktemp("worker"))
    yield proc
    proc.cleanup()


def make_worker(
    url: str, use_shm: bool, seed: int, layerwise: bool | None = None, **fields: object
) -> tuple[WorkerSide, list[torch.Tensor]]:
    config = ConnectorConfig(url=url, chunk_size=CHUNK, use_shm=use_shm, **fields)  # type: ignore[arg-type]
    worker = WorkerSide(
        NAMESPACE,
        ServerLink(config, NAMESPACE, "test-worker"),
        StatsRecorder(),
        num_blocks=NUM_BLOCKS,
        page_order="BHNC",
        layerwise=layerwise,
    )
    gen = torch.Generator().manual_seed(seed)
    layers = [
        torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE, generator=gen).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    worker.register_kv_caches({f"model.layers.{i}.attn": t for i, t in enumerate(layers)})
    return worker, layers


def wait_stored(server: ServerProc, num_chunks: int) -> None:
    with CacheClient(server.socket) as client:
        ns_id = client.register_namespace(NAMESPACE)
        wait_until(
            lambda: client.lookup(ns_id, HASHES).num_hit_chunks >= num_chunks,
            5,
            f"{num_chunks} chunks committed",
        )


def clear_server(server: ServerProc) -> None:
    with CacheClient(server.socket) as client:
        client.delete(client.register_namespace(NAMESPACE), HASHES)


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "inline"])
def test_saved_chunks_load_into_other_blocks(server: ServerProc, use_shm: bool) -> None:
    clear_server(server)
    src, src_layers = make_worker(server.socket, use_shm, seed=1)
    save = StepPlan(saves=[SavePlan("r1", (HASHES[:2],), (3, 4, 9, 2))])
    src.bind(save)
    src.wait_for_save(save)
    wait_stored(server, 2)

    dst, dst_layers = make_worker(server.socket, use_shm, seed=2)
    # vLLM already holds the first block: load chunk 0's second block, then chunk 1.
    load = StepPlan(loads=[LoadPlan("r2", (HASHES[:2],), 1, (7, 5, 6), is_async=False)])
    dst.bind(load)
    dst.start_load(load)
    assert dst.take_load_errors() == set()
    for s, d in zip(src_layers, dst_layers):
        assert torch.equal(d[7], s[4]) and torch.equal(d[5], s[9]) and torch.equal(d[6], s[2])
    src.shutdown()
    dst.shutdown()


def test_a_held_request_is_reported_once_its_chunks_are_copied(server: ServerProc) -> None:
    clear_server(server)
    worker, layers = make_worker(server.socket, True, seed=3)
    plan = StepPlan(saves=[SavePlan("r1", (HASHES[:2],), (3, 4, 9, 2))], held=["r1"])
    saved = [layer[[3, 4, 9, 2]].clone() for layer in layers]
    worker.bind(plan)
    assert worker.take_saved() == set()  # not before the copy
    worker.wait_for_save(plan)
    assert worker.take_saved() == {"r1"}
    assert worker.take_saved() == set()  # reported once
    # The blocks may be reused now: overwriting them does not change what was stored.
    for layer in layers:
        layer[[3, 4, 9, 2]] = 0
    wait_stored(server, 2)
    dst, dst_layers = make_worker(server.socket, True, seed=4)
    load = StepPlan(loads=[LoadPlan("r2", (HASHES[:2],), 0, (5, 6, 7, 8), is_async=False)])
    dst.bind(load)
    dst.start_load(load)
    assert dst.take_load_errors() == set()
    assert all(torch.equal(d[5:9], s) for d, s in zip(dst_layers, saved))
    worker.shutdown()
    dst.shutdown()


def test_layerwise_saves_and_waits_round_trip(server: ServerProc) -> None:
    # CUDA's per-layer flow, run synchronously on the CPU: layer 0 is saved as soon as it
    # "ran" (the reservation is there), wait_for_save saves the other layers only
    clear_server(server)
    src, src_layers = make_worker(server.socket, True, seed=5, layerwise=True)
    save = StepPlan(saves=[SavePlan("r1", (HASHES[:2],), (3, 4, 9, 2))])
    src.bind(save)
    assert src._reservation is not None
    src._reservation.result(timeout=10)
    src.save_layer("model.layers.0.attn")
    saved_page = src_layers[0][3].clone()
    src_layers[0][3].zero_()  # written after its layer was saved: must not reach the server
    src.save_layer("not.a.layer")  # ignored
    src.wait_for_save(save)
    wait_stored(server, 2)

    dst, dst_layers = make_worker(server.socket, True, seed=6, layerwise=True)
    load = StepPlan(loads=[LoadPlan("r2", (HASHES[:2],), 0, (0, 7, 5, 6), is_async=False)])
    dst.bind(load)
    dst.start_load(load)
    for i in range(LAYERS):
        dst.wait_for_layer(f"model.layers.{i}.attn")
    assert dst.take_load_errors() == set()
    assert torch.equal(dst_layers[0][0], saved_page) and saved_page.any()
    for s, d in zip(src_layers, dst_layers):
        assert torch.equal(d[7], s[4]) and torch.equal(d[5], s[9]) and torch.equal(d[6], s[2])
    assert torch.equal(dst_layers[1][0], src_layers[1][3])
    src.shutdown()
    dst.shutdown()


def test_missing_chunks_are_reported_as_failed_blocks(server: ServerProc) -> None:
    clear_server(server)
    src, _ = make_worker(server.socket, True, seed=3)
    save = StepPlan(saves=[SavePlan("r1", (HASHES[:1],), (0, 1))])
    src.bind(save)
    src.wait_for_save(save)
    wait_stored(server, 1)
    dst, _ = make_worker(server.socket, True, seed=4)
    load = StepPlan(loads=[LoadPlan("r2", (HASHES[:3],), 0, (8, 9, 10, 11, 12, 13), False)])
    dst.start_load(load)
    assert dst.take_load_errors() == {10, 11, 12, 13}  # chunks 1 and 2 are not there
    src.shutdown()
    dst.shutdown()


def test_async_load_reports_the_request_when_done(server: ServerProc) -> None:
    clear_server(server)
    src, src_layers = make_worker(server.socket, True, seed=5)
    save = StepPlan(saves=[SavePlan("r1", (HASHES[:1],), (5, 6))])
    src.bind(save)
    src.wait_for_save(save)
    wait_stored(server, 1)
    dst, dst_layers = make_worker(server.socket, True, seed=6)
    dst.start_load(StepPlan(loads=[LoadPlan("r2", (HASHES[:1],), 0, (1, 2), is_async=True)]))
    finished: set[str] = set()
    wait_until(
        lambda: finished.update(dst.take_finished()) or finished,
        5,
        "the async load reported finished",
    )
    assert finished == {"r2"} and dst.take_load_errors() == set()
    assert all(torch.equal(d[1:3], s[5:7]) for s, d in zip(src_layers, dst_layers))
    src.shutdown()
    dst.shutdown()


def test_a_dead_server_fails_loads_and_skips_saves(monkeypatch: pytest.MonkeyPatch) -> None:
    """One refused connection (no deadline waited for); the back-off skips the rest."""
    attempts = count_calls(monkeypatch, CacheClient, "register_namespace")
    outages = count_calls(monkeypatch, ServerLink, "_mark_down")
    worker, layers = make_worker("/nonexistent/lmcache.sock", True, seed=7, retry_interval_s=3600.0)
    before = [t.clone() for t in layers]
    # The worker's warm-up (on its I/O thread) makes the one try: wait for it, or the step
    # below races it to a second first try (2 attempts in one run).
    wait_until(lambda: outages, 10, "the warm-up's failed try")
    plan = StepPlan(
        loads=[LoadPlan("r1", (HASHES[:1],), 0, (1, 2), False)],
        saves=[SavePlan("r2", (HASHES[1:2],), (3, 4))],
        held=["r2"],
    )
    worker.bind(plan)
    worker.start_load(plan)
    worker.wait_for_save(plan)
    # The save was given up: vLLM may free the finished request's blocks all the same.
    assert worker.take_saved() == {"r2"}
    assert len(attempts) == 1, "calls in the back-off tried the server"
    ((what, error),) = outages
    assert isinstance(error, ServerUnavailable) and "UNAVAILABLE" in str(error)  # refused
    assert worker.take_load_errors() == {1, 2}
    assert all(torch.equal(a, b) for a, b in zip(layers, before))
    data = worker.stats.take()
    assert data is not None and data["save_skipped_chunks"] == 1 and data["save_chunks"] == 0
    worker.shutdown()


def test_a_failing_async_load_still_finishes_the_request(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # An exception on the loader thread used to vanish into an unread future: the request
    # was never reported finished and vLLM waited for it forever.
    dst, _ = make_worker(server.socket, True, seed=8, read_in_place=False)

    def broken_acquire(*args: object, **kwargs: object) -> None:
        raise RuntimeError("acquire broke")

    monkeypatch.setattr(dst.link, "acquire", broken_acquire)
    dst.start_load(StepPlan(loads=[LoadPlan("r3", (HASHES[:1],), 0, (1, 2), is_async=True)]))
    finished: set[str] = set()
    wait_until(
        lambda: finished.update(dst.take_finished()) or finished,
        5,
        "the failed async load reported finished",
    )
    assert finished == {"r3"} and dst.take_load_errors() == {1, 2}  # recomputed
    assert "loading request r3 failed" in caplog.text and "acquire broke" in caplog.text
    dst.shutdown()


def test_failures_on_the_io_thread_are_logged_and_reach_nothing_in_vllm(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clear_server(server)
    worker, _ = make_worker(server.socket, True, seed=9)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the link broke")

    save = StepPlan(saves=[SavePlan("r4", (HASHES[:1],), (5, 6))])
    monkeypatch.setattr(worker.link, "publish", broken)
    worker.bind(save)
    worker.wait_for_save(save)  # the commit fails on the I/O thread
    monkeypatch.setattr(worker.link, "reserve", broken)
    worker.bind(save)
    worker.wait_for_save(save)  # the reservation fails: skipped, not raised
    worker.shutdown()  # waits for the I/O thread
    assert "_publish failed on the I/O thread" in caplog.text
    assert "reserving store slots failed" in caplog.text
    assert caplog.text.count("the link broke") >= 2


# -- loads without a lease (read_in_place) -------------------------------------------------


def _saved(server: ServerProc, seed: int, hashes: tuple[bytes, ...], blocks: tuple[int, ...]):
    """A worker that saved ``hashes`` from ``blocks``, and its layers."""
    src, layers = make_worker(server.socket, True, seed=seed)
    save = StepPlan(saves=[SavePlan(f"save-{seed}", (hashes,), blocks)])
    src.bind(save)
    src.wait_for_save(save)
    return src, layers


def _ready_worker(server: ServerProc, seed: int) -> tuple[WorkerSide, list[torch.Tensor]]:
    dst, layers = make_worker(server.socket, True, seed=seed)
    dst.link.warm_up()  # the segment and the index mapped before the first load
    return dst, layers


def test_loads_read_in_place_take_no_lease(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    clear_server(server)
    src, src_layers = _saved(server, 11, HASHES[:2], (3, 4, 9, 2))
    wait_stored(server, 2)
    leases = count_calls(monkeypatch, CacheClient, "prepare_load")
    touches = count_calls(monkeypatch, CacheClient, "touch")
    copies = count_calls(monkeypatch, PageMover, "load")
    dst, dst_layers = _ready_worker(server, 12)
    load = StepPlan(loads=[LoadPlan("r5", (HASHES[:2],), 1, (7, 5, 6), is_async=False)])
    dst.bind(load)
    dst.start_load(load)
    assert dst.take_load_errors() == set()
    for s, d in zip(src_layers, dst_layers):
        assert torch.equal(d[7], s[4]) and torch.equal(d[5], s[9]) and torch.equal(d[6], s[2])
    assert leases == []
    # The server hears of the read at the next step, not during this one.
    time.sleep(0.2)
    assert touches == []
    dst.bind(StepPlan())
    wait_until(lambda: touches, 5, "the server told what was read")
    assert [list(hashes) for _, hashes in touches] == [list(HASHES[:2])]
    data = dst.stats.take()
    assert data is not None and data["load_chunks"] == data["load_in_place_chunks"] == 2
    assert data["load_in_place_retries"] == 0
    # Off: the same load takes a lease.
    off, _ = make_worker(server.socket, True, seed=13, read_in_place=False)
    off.link.warm_up()
    off.start_load(load)
    assert off.take_load_errors() == set() and len(leases) == 1
    # Both loads told the copies where each chunk lies in the segment (``_host_copies``).
    assert len(copies) == 2
    for (chunks,) in copies:
        offsets = [c.offset for c in chunks]
        assert None not in offsets and len(set(offsets)) == 2
    for w in (src, dst, off):
        w.shutdown()


def test_chunks_stored_side_by_side_load_in_place_through_one_view(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks one after another in the arena, into a run of blocks (here counting down, as
    vLLM hands out freed blocks): one view of them all is copied, with no view, plan or
    copy per chunk (``PageMover.load_span``); the bytes land as per chunk."""
    server = start_server(tmp_path)  # its own: the first save takes the first slots
    try:
        src, src_layers = _saved(server, 14, HASHES[:2], (3, 4, 9, 2))
        wait_stored(server, 2)
        spans = count_calls(monkeypatch, PageMover, "load_span")
        per_chunk = count_calls(monkeypatch, PageMover, "load")
        dst, dst_layers = _ready_worker(server, 15)
        load = StepPlan(loads=[LoadPlan("r6", (HASHES[:2],), 0, (13, 12, 11, 10), False)])
        dst.bind(load)
        dst.start_load(load)
        dst.wait_for_save(load)
        assert dst.take_load_errors() == set()
        for s, d in zip(src_layers, dst_layers):
            assert all(torch.equal(d[b], s[a]) for a, b in zip((3, 4, 9, 2), (13, 12, 11, 10)))
        assert len(spans) == 1 and per_chunk == []
        # Blocks that are not one run: a copy per chunk's runs.
        other = StepPlan(loads=[LoadPlan("r7", (HASHES[:2],), 0, (1, 5, 6, 7), False)])
        dst.bind(other)
        dst.start_load(other)
        dst.wait_for_save(other)
        assert dst.take_load_errors() == set() and len(per_chunk) == 1
        for s, d in zip(src_layers, dst_layers):
            assert all(torch.equal(d[b], s[a]) for a, b in zip((3, 4, 9, 2), (1, 5, 6, 7)))
        for w in (src, dst):
            w.shutdown()
    finally:
        server.cleanup()


def test_an_idle_engine_tells_the_server_what_it_read_in_place(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No next step (the engine went idle after the request): told after the delay."""
    clear_server(server)
    src, _ = _saved(server, 14, HASHES[:1], (3, 4))
    wait_stored(server, 1)
    monkeypatch.setattr(worker_module, "TOUCH_DELAY_S", 0.05)
    touches = count_calls(monkeypatch, CacheClient, "touch")
    dst, _ = _ready_worker(server, 15)
    load = StepPlan(loads=[LoadPlan("r6", (HASHES[:1],), 0, (7, 5), is_async=False)])
    dst.bind(load)
    dst.start_load(load)
    assert dst.take_load_errors() == set()
    wait_until(lambda: touches, 5, "the server told what was read")
    assert [list(hashes) for _, hashes in touches] == [list(HASHES[:1])]
    for w in (src, dst):
        w.shutdown()


def test_a_chunk_freed_and_overwritten_during_the_copy_is_not_kept(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the worker copies chunk 1 in place, the server drops it and another chunk's
    store takes the freed slot: the copy may hold that chunk's bytes. The check after the
    copy sees chunk 1's entry gone, the load is made again under a lease, and chunk 1's
    blocks (gone from the server) are recomputed, never served with the other's bytes."""
    clear_server(server)
    src, src_layers = _saved(server, 21, HASHES[:2], (3, 4, 9, 2))
    wait_stored(server, 2)
    dst, dst_layers = _ready_worker(server, 22)
    leases = count_calls(monkeypatch, CacheClient, "prepare_load")
    copy_in = dst._copy_in  # noqa: SLF001
    overwritten: list[WorkerSide] = []

    def copy_after_a_change(*args: object) -> object:
        if not overwritten:  # the first copy: the in-place one
            with CacheClient(server.socket) as client:
                assert client.delete(client.register_namespace(NAMESPACE), HASHES[1:2]) == 1
            other, _ = _saved(server, 23, HASHES[2:3], (0, 1))  # takes the freed slot
            overwritten.append(other)
        return copy_in(*args)

    monkeypatch.setattr(dst, "_copy_in", copy_after_a_change)
    load = StepPlan(loads=[LoadPlan("r6", (HASHES[:2],), 0, (7, 5, 6, 8), is_async=False)])
    dst.bind(load)
    dst.start_load(load)
    assert dst.take_load_errors() == {6, 8}  # chunk 1: recomputed
    assert len(leases) == 1  # loaded again under a lease
    for s, d in zip(src_layers, dst_layers):
        assert torch.equal(d[7], s[3]) and torch.equal(d[5], s[4])  # chunk 0: good
    data = dst.stats.take()
    assert data is not None and data["load_in_place_retries"] == 1
    assert data["load_in_place_chunks"] == 0 and data["load_chunks"] == 1
    for w in (src, dst, *overwritten):
        w.shutdown()


def test_a_step_with_loads_reserves_its_save_slots_after_the_copies(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reservation call would compete with the load's copies for the interpreter: a
    step that loads asks for its save slots once the loads are copied, still before the
    forward pass; a step without loads asks at once."""
    clear_server(server)
    src, src_layers = _saved(server, 31, HASHES[:1], (3, 4))
    wait_stored(server, 1)
    dst, dst_layers = _ready_worker(server, 32)
    order: list[str] = []
    copy_in, reserve = dst._copy_in, dst.link.reserve  # noqa: SLF001

    def copying(*args: object) -> object:
        order.append("copy")
        return copy_in(*args)

    def reserving(*args: object) -> object:
        order.append("reserve")
        return reserve(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(dst, "_copy_in", copying)
    monkeypatch.setattr(dst.link, "reserve", reserving)
    plan = StepPlan(
        loads=[LoadPlan("r7", (HASHES[:1],), 0, (7, 5), is_async=False)],
        saves=[SavePlan("r7", (HASHES[:2],), (7, 5, 9, 10))],
    )
    dst.bind(plan)
    assert dst._reservation is None  # noqa: SLF001
    dst.start_load(plan)
    dst.wait_for_save(plan)
    assert order == ["copy", "reserve"] and dst.take_load_errors() == set()
    assert all(torch.equal(d[7], s[3]) for s, d in zip(src_layers, dst_layers))
    wait_stored(server, 2)  # chunk 1 saved from blocks 9 and 10
    saves_only = StepPlan(saves=[SavePlan("r8", (HASHES[2:3],), (11, 12))])
    dst.bind(saves_only)
    assert dst._reservation is not None  # noqa: SLF001
    dst.wait_for_save(saves_only)
    wait_stored(server, 3)
    for w in (src, dst):
        w.shutdown()

"""CPU loads that copy beside the forward pass (``overlap_loads``).

Against a real server, with the worker's own copy thread held back by a gate, so the tests
see each moment: ``start_load`` returning before any layer is in place, each layer in place
once its wait returns, the checks after the forward pass.
"""

# ruff: noqa: E402  (imports after the torch check)
from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

pytest.importorskip("torch", reason="the layout code needs torch (the [torch] extra)")
import torch
from lmcache_svc_vllm import mover as mover_module
from lmcache_svc_vllm.config import Tuning
from lmcache_svc_vllm.copy_thread import CopyFailed, CopyThread
from lmcache_svc_vllm.metadata import LoadPlan, StepPlan
from lmcache_svc_vllm.worker import WorkerSide

from lmcache_svc.client import CacheClient
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.helpers import count_calls, wait_until
from tests.vllm.test_worker_side import (
    HASHES,
    NAMESPACE,
    _saved,
    clear_server,
    make_worker,
    wait_stored,
)

LAYER_0, LAYER_1 = "model.layers.0.attn", "model.layers.1.attn"
# Chunk 0 (saved from blocks 3, 4) into 7, 5; chunk 1 (from 9, 2) into 6, 8.
LOAD = StepPlan(loads=[LoadPlan("r-overlap", (HASHES[:2],), 0, (7, 5, 6, 8), is_async=False)])
SRC_BLOCKS, DST_BLOCKS = (3, 4, 9, 2), (7, 5, 6, 8)


def _worker(
    server: ServerProc, seed: int, min_bytes: int = 0, **fields: object
) -> tuple[WorkerSide, list[torch.Tensor]]:
    """A worker whose loads of at least ``min_bytes`` copy on its copy thread."""
    worker, layers = make_worker(
        server.socket, True, seed, tuning=Tuning(overlap_load_min_bytes=min_bytes), **fields
    )
    worker.link.warm_up()
    return worker, layers


def _hold(worker: WorkerSide) -> threading.Event:
    """Keep the worker's copy thread busy until the returned gate is set."""
    copier = worker._copier  # noqa: SLF001
    assert copier is not None
    gate = threading.Event()
    copier.copy_layers(lambda _: gate.wait(10), [0])
    return gate


def _loaded(src: list[torch.Tensor], dst: list[torch.Tensor], layer: int, chunks: int) -> bool:
    pairs = list(zip(SRC_BLOCKS, DST_BLOCKS))[: 2 * chunks]
    return all(torch.equal(dst[layer][d], src[layer][s]) for s, d in pairs)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    proc = start_server(tmp_path_factory.mktemp("overlap"))
    yield proc
    proc.cleanup()


@pytest.fixture
def saved(server: ServerProc) -> Iterator[list[torch.Tensor]]:
    clear_server(server)
    src, layers = _saved(server, 31, HASHES[:2], SRC_BLOCKS)
    wait_stored(server, 2)
    yield layers
    src.shutdown()


def test_start_load_returns_before_the_copies_and_each_layer_is_in_place_by_its_wait(
    server: ServerProc,
    saved: list[torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    leases = count_calls(monkeypatch, CacheClient, "prepare_load")
    dst, layers = _worker(server, 32)
    before = [layer.clone() for layer in layers]
    gate = _hold(dst)
    dst.bind(LOAD)
    dst.start_load(LOAD)  # returns while the copy thread is held
    assert all(torch.equal(a, b) for a, b in zip(layers, before))
    waiter = threading.Thread(target=dst.wait_for_layer, args=(LAYER_0,))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # the forward pass would wait here
    gate.set()
    waiter.join(5)
    assert not waiter.is_alive() and _loaded(saved, layers, 0, 2)
    dst.wait_for_layer(LAYER_1)
    assert _loaded(saved, layers, 1, 2)
    dst.wait_for_save(LOAD)
    assert dst.take_load_errors() == set()
    assert leases == []  # read in place, no lease
    data = dst.stats.take()
    assert data is not None and data["load_in_place_chunks"] == 2
    assert data["load_in_place_late_changes"] == data["load_in_place_retries"] == 0
    dst.shutdown()


def test_the_layers_have_work_only_while_a_load_copies(
    server: ServerProc,
    saved: list[torch.Tensor],
) -> None:
    """``per_layer`` (what the connector tells vLLM's layers: ``has_connector_metadata``):
    yes while a load copies beside the forward pass, no once it is in, or with no load."""
    dst, _ = _worker(server, 36)
    assert not dst.per_layer()
    gate = _hold(dst)
    dst.bind(LOAD)
    dst.start_load(LOAD)
    assert dst.per_layer()  # copying: each layer waits for its KV
    gate.set()
    dst.wait_for_layer(LAYER_1)  # the last layer: all in
    assert not dst.per_layer()
    dst.wait_for_save(LOAD)
    dst.bind(StepPlan())
    dst.start_load(StepPlan())
    assert not dst.per_layer()
    assert dst.take_load_errors() == set()
    dst.shutdown()


def test_an_unknown_layer_waits_for_every_layer(
    server: ServerProc,
    saved: list[torch.Tensor],
) -> None:
    dst, layers = _worker(server, 33)
    gate = _hold(dst)
    dst.bind(LOAD)
    dst.start_load(LOAD)
    threading.Timer(0.2, gate.set).start()
    dst.wait_for_layer("model.layers.99.attn")
    assert gate.is_set() and _loaded(saved, layers, 1, 2)
    assert dst.take_load_errors() == set()
    dst.shutdown()


def test_a_chunk_that_changed_while_it_copied_beside_the_forward_is_recomputed(
    server: ServerProc,
    saved: list[torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunk 1 is freed and its slot taken by another chunk after ``start_load`` located it
    and before the copy thread copied it: the forward pass has used the bytes, so there is
    no lease retry; chunk 1's blocks are reported failed with this step's output."""
    dst, layers = _worker(server, 34)
    leases = count_calls(monkeypatch, CacheClient, "prepare_load")
    gate = _hold(dst)
    dst.bind(LOAD)
    dst.start_load(LOAD)
    with CacheClient(server.socket) as client:
        assert client.delete(client.register_namespace(NAMESPACE), HASHES[1:2]) == 1
    other, _ = _saved(server, 35, HASHES[2:3], (0, 1))  # takes the freed slot
    gate.set()
    dst.wait_for_layer(LAYER_1)
    assert dst.take_load_errors() == {6, 8}
    assert leases == []
    assert _loaded(saved, layers, 0, 1) and _loaded(saved, layers, 1, 1)  # chunk 0 good
    data = dst.stats.take()
    assert data is not None and data["load_in_place_late_changes"] == 1
    assert data["load_in_place_chunks"] == 1 and data["load_failed_blocks"] == 2
    for w in (dst, other):
        w.shutdown()


def test_a_failed_copy_on_the_copy_thread_recomputes_the_load(
    server: ServerProc,
    saved: list[torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    into = mover_module._HostCopy.into  # noqa: SLF001

    def fail_on_the_copy_thread(self: object, kv: object, layer: int) -> None:
        if threading.current_thread().name.startswith("lmcache-svc-copy"):
            raise OSError("planted")
        into(self, kv, layer)  # type: ignore[arg-type]

    monkeypatch.setattr(mover_module._HostCopy, "into", fail_on_the_copy_thread)  # noqa: SLF001
    releases = count_calls(monkeypatch, CacheClient, "release_load")
    for read_in_place in (True, False):
        dst, _ = _worker(server, 36, read_in_place=read_in_place)
        dst.bind(LOAD)
        dst.start_load(LOAD)
        dst.wait_for_layer(LAYER_1)  # wakes, never raises into vLLM
        assert dst.take_load_errors() == set(DST_BLOCKS), read_in_place
        if not read_in_place:  # the lease is given back once the failed copy is over
            wait_until(lambda: releases, 5, "the leased load's lease released")
        dst.shutdown()  # (it cancels what the I/O thread has not started yet)


def test_a_leased_load_is_released_only_after_the_copy_thread_is_done(
    server: ServerProc,
    saved: list[torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    releases = count_calls(monkeypatch, CacheClient, "release_load")
    dst, layers = _worker(server, 37, read_in_place=False)
    gate = _hold(dst)
    dst.bind(LOAD)
    dst.start_load(LOAD)
    threading.Event().wait(0.2)
    assert releases == []  # the slots are still to be read
    gate.set()
    dst.wait_for_layer(LAYER_1)
    assert _loaded(saved, layers, 1, 2)
    wait_until(lambda: releases, 5, "the lease released")
    assert dst.take_load_errors() == set()
    dst.shutdown()


@pytest.mark.parametrize("fields", [{}, {"overlap_loads": False}], ids=["small", "off"])
def test_a_small_load_or_overlap_off_copies_every_layer_before_the_forward(
    server: ServerProc,
    saved: list[torch.Tensor],
    fields: dict[str, object],
) -> None:
    """Below ``tuning.overlap_load_min_bytes`` (4 MiB; this load is 128 KiB), or with
    ``overlap_loads`` off, ``start_load`` returns with every layer in place."""
    dst, layers = make_worker(server.socket, True, 38, **fields)
    dst.link.warm_up()
    gate = _hold(dst) if fields == {} else None
    assert (dst._copier is None) is (gate is None)  # noqa: SLF001
    dst.bind(LOAD)
    dst.start_load(LOAD)
    assert _loaded(saved, layers, 0, 2) and _loaded(saved, layers, 1, 2)
    if gate is not None:
        gate.set()
    assert dst.take_load_errors() == set()
    dst.shutdown()


def test_the_copy_thread_fails_a_layer_and_every_later_one() -> None:
    copier = CopyThread()
    done: list[int] = []

    def copy(layer: int) -> None:
        if layer == 2:
            raise ValueError("planted")
        done.append(layer)

    events = copier.copy_layers(copy, [1, 2, 3])
    events[-1].wait_on_device()  # wakes without raising
    assert done == [1] and all(e.query() for e in events)
    events[0].synchronize()
    for event in events[1:]:
        with pytest.raises(CopyFailed, match="planted"):
            event.synchronize()
    copier.shutdown()
    with pytest.raises(RuntimeError):
        copier.copy_layers(copy, [1])

"""The worker's copy path keeps the order a GPU needs, checked with a recording stream.

The worker runs its CUDA flow (layer-wise saves and load waits) on CPU tensors through
``RecordingStream`` (recording_stream.py) against a real server: its copies, event
records, waits, releases and commits must come in an order that would be safe on a GPU.
Each check is also shown failing: a test plants the broken order in the worker and asserts
the stream names it.
"""

# ruff: noqa: E402  (imports after the torch check)
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("torch", reason="the layout code needs torch (the [torch] extra)")
import torch
from lmcache_svc_vllm import worker as worker_module
from lmcache_svc_vllm.metadata import LoadPlan, SavePlan, StepPlan
from lmcache_svc_vllm.mover import LayerEvents, PageMover
from lmcache_svc_vllm.worker import WorkerSide

from lmcache_svc_bench.procs import ServerProc
from tests.helpers import wait_until
from tests.vllm.recording_stream import RecordingStream
from tests.vllm.test_worker_side import HASHES, LAYERS, clear_server, make_worker, wait_stored
from tests.vllm.test_worker_side import server as server  # the fixture

SAVE = StepPlan(saves=[SavePlan("r1", (HASHES[:2],), (3, 4, 9, 2))])
LOAD = StepPlan(loads=[LoadPlan("r2", (HASHES[:2],), 0, (0, 7, 5, 6), is_async=False)])


def layer_name(i: int) -> str:
    return f"model.layers.{i}.attn"


@pytest.fixture
def recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[..., tuple[WorkerSide, list[torch.Tensor], RecordingStream]]]:
    """Workers whose mover copies through a RecordingStream and whose link is guarded."""
    workers: list[WorkerSide] = []

    def make(url: str, seed: int) -> tuple[WorkerSide, list[torch.Tensor], RecordingStream]:
        stream = RecordingStream()
        monkeypatch.setattr(worker_module, "copy_stream_for", lambda device: stream)
        worker, layers = make_worker(url, True, seed=seed, layerwise=True)
        stream.guard(worker.link)
        workers.append(worker)
        return worker, layers, stream

    yield make
    for worker in workers:
        worker.shutdown()


@pytest.fixture
def held_release(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Holds the worker's background release until the test sets the event: a host-side
    wait on the load's copies would otherwise make every layer visible whenever that
    thread happens to run, and the device-side waits would go unchecked."""
    go = threading.Event()
    release_after = WorkerSide._release_after

    def held(self: WorkerSide, events: LayerEvents | None, acquired: Any) -> None:
        go.wait(10)
        release_after(self, events, acquired)

    monkeypatch.setattr(WorkerSide, "_release_after", held)
    yield go
    go.set()


def save_step(worker: WorkerSide, layers: list[torch.Tensor], stream: RecordingStream) -> None:
    """One step of the CUDA flow: each layer is written by the forward pass, then saved as
    soon as it ran (``save_layer``); ``wait_for_save`` copies what is left and commits."""
    worker.bind(SAVE)
    assert worker._reservation is not None
    worker._reservation.result(timeout=10)
    for i, kv in enumerate(layers):
        stream.write_layer(kv)
        worker.save_layer(layer_name(i))
    worker.wait_for_save(SAVE)


def stored(server: ServerProc, make: Callable[..., Any]) -> None:
    clear_server(server)
    worker, layers, stream = make(server.socket, seed=1)
    save_step(worker, layers, stream)
    wait_stored(server, 2)
    assert stream.violations == []


def test_the_workers_copy_path_keeps_every_order(
    server: ServerProc, recorded: Any, held_release: threading.Event
) -> None:
    clear_server(server)
    src, src_layers, saves = recorded(server.socket, seed=1)
    save_step(src, src_layers, saves)
    wait_stored(server, 2)
    assert saves.num_publishes == 1 and len(saves.ops) > 0

    dst, dst_layers, loads = recorded(server.socket, seed=2)
    dst.bind(LOAD)
    dst.start_load(LOAD)
    for i, kv in enumerate(dst_layers):
        dst.wait_for_layer(layer_name(i))
        loads.use_layer(kv)
    held_release.set()
    wait_until(lambda: loads.num_releases == 1, 10, "the lease released")
    assert saves.violations == [] and loads.violations == [], loads.log
    assert loads.num_layer_uses == LAYERS
    assert all(torch.equal(d[7], s[4]) for s, d in zip(src_layers, dst_layers))


def test_a_layer_used_before_its_load_was_waited_on_is_caught(
    server: ServerProc, recorded: Any, held_release: threading.Event
) -> None:
    stored(server, recorded)
    dst, dst_layers, loads = recorded(server.socket, seed=2)
    dst.bind(LOAD)
    dst.start_load(LOAD)
    dst.wait_for_layer(layer_name(0))
    loads.use_layer(dst_layers[0])
    assert loads.violations == []
    loads.use_layer(dst_layers[1])  # planted: layer 1 runs without wait_for_layer
    assert len(loads.violations) == 1
    assert loads.violations[0].startswith("a layer was used before the event after its load")


def test_a_lease_released_before_its_copies_completed_is_caught(
    server: ServerProc, recorded: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def release_first(self: WorkerSide, events: LayerEvents | None, acquired: Any) -> None:
        self.link.release(acquired)  # planted: the release before the copies' event
        if events is not None:
            events.synchronize()

    stored(server, recorded)
    monkeypatch.setattr(WorkerSide, "_release_after", release_first)
    dst, _, loads = recorded(server.socket, seed=2)
    dst.bind(LOAD)
    dst.start_load(LOAD)
    wait_until(lambda: loads.num_releases == 1, 10, "the lease released")
    assert len(loads.violations) == 1
    assert loads.violations[0].startswith("a lease was released before its copies completed")


def test_slots_committed_before_their_copies_finished_are_caught(
    server: ServerProc, recorded: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def copy_out_without_waiting(self: WorkerSide, reservation: Any) -> bool:
        chunks = self._chunk_saves(reservation)
        assert chunks is not None and self._mover is not None
        self._mover.save(chunks)  # planted: no synchronize before the commit
        return True

    clear_server(server)
    monkeypatch.setattr(WorkerSide, "_copy_out", copy_out_without_waiting)
    src, _, saves = recorded(server.socket, seed=1)
    src.bind(SAVE)
    src.wait_for_save(SAVE)
    wait_until(lambda: saves.num_publishes == 1, 10, "the slots committed")
    assert len(saves.violations) == 1
    assert saves.violations[0].startswith("slots were committed before their copies completed")


def test_a_save_that_does_not_follow_the_forward_pass_is_caught(
    server: ServerProc, recorded: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def save_without_following(self: PageMover, chunks: Any, layers: Any = None) -> LayerEvents:
        todo = range(len(self.pages.layers)) if layers is None else layers
        with self.stream.activate():  # planted: no follow_current() first
            ids = self._gather_ids(chunks)
            return LayerEvents([self._save_layer(i, chunks, ids) for i in todo])

    clear_server(server)
    monkeypatch.setattr(PageMover, "save", save_without_following)
    src, src_layers, saves = recorded(server.socket, seed=1)
    save_step(src, src_layers, saves)
    assert saves.violations
    assert all("compute stream wrote after" in v for v in saves.violations)

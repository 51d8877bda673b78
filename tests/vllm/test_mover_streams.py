"""The device path's gathers and scatters run on a side stream, beside the copies: every
hand-over of scratch between the two streams must be ordered by an event. Checked on CPU
tensors with two recording streams (``recording_stream.py``), in loads and saves of
several units (groups of layers, batches of chunks) that take turns with two scratch
buffers; each missing wait is shown caught."""

# ruff: noqa: E402  (imports after the torch check)
from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch", reason="the layout code needs torch (the [torch] extra)")
import torch
from lmcache_svc_vllm import mover as mover_module
from lmcache_svc_vllm.layout import KVPages
from lmcache_svc_vllm.mover import ChunkLoad, ChunkSave, LayerEvents, PageMover

from tests.vllm.recording_stream import RecordingStream
from tests.vllm.test_mover import BLOCKS_PER_CHUNK, SHAPE, make_pages

NUM_CHUNKS = 3
GROUP_BYTES = 20_000  # 2 of the 3 layers per group (16 KiB of a chunk per layer)


@pytest.fixture(autouse=True)
def small_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two buffers, each for one chunk of a 2-layer group: 5 units ([0, 1] x 3 chunks,
    [2] x 2 + 1)."""
    monkeypatch.setattr(mover_module, "SCRATCH_BYTES", 2 * 2 * BLOCKS_PER_CHUNK * 4096)


def drop_waits(monkeypatch: pytest.MonkeyPatch, of: int) -> None:
    """Plant the bug: stream ``of`` (0: the copy stream, 1: the side stream) never waits
    for the other one's events."""
    wait_for = RecordingStream.wait_for

    def dropping(self: RecordingStream, event: Any) -> None:
        if self.index != of:
            wait_for(self, event)

    monkeypatch.setattr(RecordingStream, "wait_for", dropping)


def saved(seed: int, stream: RecordingStream, **kw: Any) -> tuple[bytes, bytes]:
    """Save NUM_CHUNKS chunks of scattered blocks; (what the slots hold, what they should)."""
    rng = random.Random(seed)
    pages, _ = make_pages(seed)
    bpc, n = BLOCKS_PER_CHUNK, pages.geometry.chunk_bytes
    src = rng.sample(range(SHAPE.num_blocks), bpc * NUM_CHUNKS)
    slots, want = memoryview(bytearray(NUM_CHUNKS * n)), bytearray(NUM_CHUNKS * n)
    saves = []
    for i in range(NUM_CHUNKS):
        ids = src[i * bpc : (i + 1) * bpc]
        saves.append(ChunkSave(ids, pages.chunk_tensor(slots[i * n : (i + 1) * n])))
        pages.copy_chunk_out(ids, pages.chunk_tensor(memoryview(want)[i * n : (i + 1) * n]))
    PageMover(pages, stream, gather="index", group_bytes=GROUP_BYTES, unit_bytes=0, **kw).save(
        saves
    ).synchronize()
    return bytes(slots), bytes(want)


def loaded(
    seed: int, stream: RecordingStream, **kw: Any
) -> tuple[KVPages, list[torch.Tensor], LayerEvents]:
    """Load NUM_CHUNKS chunks into scattered blocks; (the pages, what they should hold,
    the layers' events)."""
    rng = random.Random(seed)
    pages, _ = make_pages(seed)
    chunks, _ = make_pages(seed + 1)  # random bytes to load
    bpc, n = BLOCKS_PER_CHUNK, pages.geometry.chunk_bytes
    slots = memoryview(bytearray(NUM_CHUNKS * n))
    for i in range(NUM_CHUNKS):
        chunks.copy_chunk_out(range(i * bpc, (i + 1) * bpc), pages.chunk_tensor(slots[i * n :][:n]))
    want = KVPages([layer.clone() for layer in pages.layers], bpc)
    to = rng.sample(range(SHAPE.num_blocks), bpc * NUM_CHUNKS)
    loads = []
    for i in range(NUM_CHUNKS):
        ids, chunk = to[i * bpc : (i + 1) * bpc], slots[i * n : (i + 1) * n]
        loads.append(ChunkLoad(chunk, 0, ids))
        want.copy_chunk_in(pages.chunk_tensor(chunk), 0, ids)
    mover = PageMover(pages, stream, gather="index", group_bytes=GROUP_BYTES, unit_bytes=0, **kw)
    return pages, want.layers, mover.load(loads)


@pytest.mark.parametrize("seed", range(3))
def test_gathers_and_scatters_run_beside_the_copies_in_order(seed: int) -> None:
    saves = RecordingStream()
    got, want = saved(seed, saves)
    assert got == want
    loads = RecordingStream()
    pages, expected, events = loaded(seed, loads)
    for i, kv in enumerate(pages.layers):
        events.wait_on_device(i)
        loads.use_layer(kv)
        assert torch.equal(kv, expected[i])
    for stream in (saves, loads):
        assert stream.violations == [], stream.log
        # the copies on the copy stream, the gathers or scatters on its side stream
        assert {op.name for op in stream.ops if op.stream == 0} == {"copy_"}
        assert {op.stream for op in stream.ops if op.name != "copy_"} == {1}
    assert len(events.events) == SHAPE.num_layers


def test_without_overlap_everything_runs_on_the_copy_stream() -> None:
    stream = RecordingStream()
    got, want = saved(0, stream, overlap=False)
    pages, expected, _ = loaded(0, stream, overlap=False)
    assert got == want and all(map(torch.equal, pages.layers, expected))
    assert stream.violations == [] and {op.stream for op in stream.ops} == {0}


@pytest.mark.parametrize("waiter", [0, 1], ids=["copy-stream", "side-stream"])
@pytest.mark.parametrize("direction", ["save", "load"])
def test_a_missing_wait_between_the_streams_is_caught(
    monkeypatch: pytest.MonkeyPatch, direction: str, waiter: int
) -> None:
    drop_waits(monkeypatch, of=waiter)
    stream = RecordingStream()
    if direction == "save":
        saved(0, stream)
    else:
        loaded(0, stream)
    assert stream.violations and all(v.startswith("a race:") for v in stream.violations)


def test_a_layer_of_a_later_group_used_after_an_earlier_groups_event_is_caught() -> None:
    stream = RecordingStream()
    pages, _, events = loaded(0, stream)
    events.wait_on_device(0)  # layers 0 and 1: the first group
    stream.use_layer(pages.layers[1])
    assert stream.violations == []
    stream.use_layer(pages.layers[2])  # planted: layer 2 without its own wait
    assert len(stream.violations) == 1
    assert stream.violations[0].startswith("a layer was used before the event after its load")


@pytest.mark.parametrize("direction", ["save", "load"])
def test_back_to_back_calls_reuse_scratch_only_after_its_last_use(direction: str) -> None:
    """The scratch goes back to the copy stream's memory when a call returns; the next
    call's copies (a load) or gathers (a save) may get the same memory, so they must be
    ordered after the last scatters or copies that used it."""
    stream = RecordingStream()
    for seed in range(3):
        if direction == "save":
            got, want = saved(seed, stream)
            assert got == want
        else:
            loaded(seed, stream)
    assert stream.violations == [], stream.log


def test_layers_in_one_buffer_are_moved_a_group_at_a_time() -> None:
    """One gather or scatter per unit where the layers are views of one buffer (vLLM's
    CUDA layout), one per layer where they are not; the same bytes either way."""
    stacked, separate = RecordingStream(), RecordingStream()
    pages, expected, _ = loaded(0, stacked)
    assert all(map(torch.equal, pages.layers, expected))
    layers, _ = make_pages(0)
    apart = KVPages([layer.clone() for layer in layers.layers], BLOCKS_PER_CHUNK)
    assert mover_module._StackedLayers.of(layers) is not None
    assert mover_module._StackedLayers.of(apart) is None
    scatters = [op for op in stacked.ops if op.stream == 1]
    assert [op.name for op in scatters] == ["index_copy_"] * 5  # one per unit
    pages, expected, _ = loaded(0, separate, stack_layers=False)
    assert all(map(torch.equal, pages.layers, expected))
    per_layer = [op for op in separate.ops if op.stream == 1]
    assert len(per_layer) == 3 * 2 + 2 * 1  # 3 units of 2 layers, 2 units of 1 layer
    got, want = saved(0, separate, stack_layers=False)  # a layer at a time, saved
    assert got == want
    assert stacked.violations == [] and separate.violations == []


@pytest.mark.parametrize("adjacent", [True, False], ids=["adjacent", "apart"])
@pytest.mark.parametrize("seed", range(3))
def test_chunks_on_the_kv_device_are_scattered_straight_from_their_bytes(
    seed: int, adjacent: bool
) -> None:
    """``direct``: chunks whose bytes are tensors on the KV's device (the HBM tier's pool)
    load by one scatter per chunk, or per run of chunks one after another in the pool, all
    layers, on the copy stream: no scratch, no copy; the layers' events cover it (the
    forward pass may use every layer after its wait)."""
    rng = random.Random(seed)
    pages, _ = make_pages(seed)
    chunks, _ = make_pages(seed + 1)
    bpc, n = BLOCKS_PER_CHUNK, pages.geometry.chunk_bytes
    pool = torch.empty(NUM_CHUNKS * n, dtype=torch.uint8)  # a device pool, here on the CPU
    want = KVPages([layer.clone() for layer in pages.layers], bpc)
    to = rng.sample(range(SHAPE.num_blocks), bpc * NUM_CHUNKS)
    loads = []
    for i in range(NUM_CHUNKS):
        slot = i if adjacent else NUM_CHUNKS - 1 - i
        src = pool[slot * n : (slot + 1) * n].view(SHAPE.num_layers, bpc, -1)
        chunks.copy_chunk_out(range(i * bpc, (i + 1) * bpc), src)
        ids = to[i * bpc : (i + 1) * bpc]
        loads.append(ChunkLoad(src, 0, ids))
        want.copy_chunk_in(src, 0, ids)
    stream = RecordingStream()
    mover = PageMover(pages, stream, gather="index", direct=True)
    events = mover.load(loads)
    for i, kv in enumerate(pages.layers):
        events.wait_on_device(i)
        stream.use_layer(kv)
        assert torch.equal(kv, want.layers[i])
    assert stream.violations == [], stream.log
    scatters = 1 if adjacent else NUM_CHUNKS
    assert [(op.name, op.stream) for op in stream.ops] == [("index_copy_", 0)] * scatters
    # Not direct: through scratch, a copy per chunk and group (and the slots' bytes alike).
    stream = RecordingStream()
    PageMover(pages, stream, gather="index", direct=False).load(loads).synchronize()
    assert {op.name for op in stream.ops} == {"copy_", "index_copy_"}


def test_chunks_next_to_each_other_in_separate_buffers_are_scattered_one_by_one() -> None:
    """Runs are told by address: chunks that lie one after another in memory but in
    separate buffers (each its own storage) are not one run (a view of the first's buffer
    cannot reach the next)."""
    pages, _ = make_pages(7)
    chunks, _ = make_pages(8)
    bpc, n = BLOCKS_PER_CHUNK, pages.geometry.chunk_bytes
    memory = np.zeros(NUM_CHUNKS * n, dtype=np.uint8)
    buffers = [torch.from_numpy(memory[i * n : (i + 1) * n]) for i in range(NUM_CHUNKS)]
    assert buffers[0].data_ptr() + n == buffers[1].data_ptr()  # next to each other
    want = KVPages([layer.clone() for layer in pages.layers], bpc)
    to = random.Random(7).sample(range(SHAPE.num_blocks), bpc * NUM_CHUNKS)
    loads = []
    for i, buffer in enumerate(buffers):
        src = buffer.view(SHAPE.num_layers, bpc, -1)
        chunks.copy_chunk_out(range(i * bpc, (i + 1) * bpc), src)
        loads.append(ChunkLoad(src, 0, to[i * bpc : (i + 1) * bpc]))
        want.copy_chunk_in(src, 0, loads[-1].block_ids)
    stream = RecordingStream()
    PageMover(pages, stream, gather="index", direct=True).load(loads).synchronize()
    assert all(map(torch.equal, pages.layers, want.layers))
    assert [op.name for op in stream.ops] == ["index_copy_"] * NUM_CHUNKS
    # One buffer: one run, unless a chunk is not in rows of the KV's pages (then no
    # scatter straight from the bytes at all).
    pool = torch.from_numpy(memory)
    srcs = [pool[i * n : (i + 1) * n].view(SHAPE.num_layers, bpc, -1) for i in range(NUM_CHUNKS)]
    mover = PageMover(pages, RecordingStream(), gather="index", direct=True)
    runs = mover._direct_runs(srcs)  # noqa: SLF001
    assert runs is not None and [(first, len(run)) for first, run in runs] == [(0, NUM_CHUNKS)]
    srcs[1] = srcs[1].view(SHAPE.num_layers, bpc, 2, -1)
    assert mover._direct_runs(srcs) is None  # noqa: SLF001

"""Batched per-layer copies (``mover.py``) on CPU tensors laid out like vLLM 0.32's CUDA KV
cache (LBNHC), through the synchronous stream seam; across two processes and a real server."""

# ruff: noqa: E402  (imports after the torch check)
from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the layout code needs torch (the [torch] extra)")
import random

import torch
from lmcache_svc_vllm import mover as mover_module
from lmcache_svc_vllm.layout import KVPages, runs_of
from lmcache_svc_vllm.mover import ChunkLoad, ChunkSave, PageMover, _host_copies
from lmcache_svc_vllm.streams import SyncStream, copy_stream_for

from lmcache_svc.client import CacheClient
from lmcache_svc.keys import chunk_hashes
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.gpu.kv_layout import KVShape, make_kv_caches, namespace_for, page_order
from tests.helpers import address_of

SHAPE = KVShape(num_layers=3, num_blocks=12, block_size=16, num_kv_heads=2, head_size=32)
BLOCKS_PER_CHUNK = 4
REPO = Path(__file__).resolve().parents[2]


def make_pages(seed: int) -> tuple[KVPages, dict[str, torch.Tensor]]:
    caches = make_kv_caches(SHAPE, seed=seed, device="cpu")
    pages = KVPages.from_kv_caches(
        caches,
        num_blocks=SHAPE.num_blocks,
        blocks_per_chunk=BLOCKS_PER_CHUNK,
        page_order=page_order(SHAPE),
    )
    return pages, caches


def test_the_layout_is_vllm_cuda_default() -> None:
    pages, caches = make_pages(0)
    kv = next(iter(caches.values()))
    # logical [B, H, N, C], physically [B, N, H, C]: heads inside tokens inside blocks
    assert kv.shape == (12, 2, 16, 64)
    assert kv.stride() == (16 * 2 * 64, 64, 2 * 64, 1)
    assert pages.geometry.page_bytes == SHAPE.page_bytes == 16 * 2 * 64 * 2
    assert runs_of([3, 4, 5, 9, 1, 2]) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]


@pytest.mark.parametrize("gather", ["index", "runs"])
def test_save_then_load_restores_pages_in_other_blocks(gather: str) -> None:
    src, _ = make_pages(1)
    dst, _ = make_pages(2)
    dst_before = [layer.clone() for layer in dst.layers]
    mover_out = PageMover(src, SyncStream(), gather=gather)  # type: ignore[arg-type]
    mover_in = PageMover(dst, SyncStream(), gather=gather)  # type: ignore[arg-type]
    buffers = [bytearray(src.geometry.chunk_bytes) for _ in range(2)]
    chunk_a, chunk_b = (src.chunk_tensor(memoryview(b)) for b in buffers)
    events = mover_out.save([ChunkSave([7, 2, 3, 11], chunk_a), ChunkSave([0, 1, 5, 4], chunk_b)])
    assert len(events.events) == SHAPE.num_layers and all(e.query() for e in events.events)
    for i, layer in enumerate(src.layers):  # layer-major, then block, in order
        assert bytes(chunk_a[i].flatten().numpy()) == bytes(layer[[7, 2, 3, 11]].flatten().numpy())
    # load chunk a's last two blocks and all of chunk b into scattered destination blocks
    mover_in.load([ChunkLoad(chunk_a, 2, [9, 6]), ChunkLoad(chunk_b, 0, [1, 10, 3, 0])])
    for s, d, before in zip(src.layers, dst.layers, dst_before):
        for got, want in [(9, 3), (6, 11), (1, 0), (10, 1), (3, 5), (0, 4)]:
            assert torch.equal(d[got], s[want])
        untouched = [b for b in range(SHAPE.num_blocks) if b not in (9, 6, 1, 10, 3, 0)]
        assert torch.equal(d[untouched], before[untouched])


def _arena(pages: KVPages, num_slots: int, seed: int) -> memoryview:
    """Chunk slots one after another, as in the server's arena, with random bytes."""
    data = random.Random(seed).randbytes(num_slots * pages.geometry.chunk_bytes)
    return memoryview(bytearray(data))


def _slot(arena: memoryview, pages: KVPages, i: int) -> memoryview:
    n = pages.geometry.chunk_bytes
    return arena[i * n : (i + 1) * n].toreadonly()


def _copies(loads: list[ChunkLoad], pages: KVPages) -> list[Any]:
    places = [(c.src, c.first_block, c.block_ids, c.offset) for c in loads]
    return _host_copies(places, pages.geometry, writeable=False)


def test_adjacent_whole_chunks_into_consecutive_blocks_are_one_copy() -> None:
    pages, _ = make_pages(4)
    arena = _arena(pages, 3, seed=4)
    bpc = BLOCKS_PER_CHUNK
    loads = [
        ChunkLoad(_slot(arena, pages, i), 0, range(1 + i * bpc, 1 + (i + 1) * bpc))
        for i in range(2)
    ]
    copies = _copies(loads, pages)
    page = pages.geometry.page_bytes
    assert [(c.chunks.shape, c.block, c.step) for c in copies] == [((2, 3, bpc, page), 1, 1)]
    # Blocks counting down (vLLM hands freed blocks out in reverse): one copy too.
    down = [
        ChunkLoad(_slot(arena, pages, i), 0, range(10 - i * bpc, 10 - (i + 1) * bpc, -1))
        for i in range(2)
    ]
    copies = _copies(down, pages)
    assert [(c.chunks.shape, c.block, c.step) for c in copies] == [((2, 3, bpc, page), 10, -1)]
    # Not adjacent in memory (slots 0 and 2), or not consecutive blocks: one copy each.
    apart = [loads[0], ChunkLoad(_slot(arena, pages, 2), 0, range(5, 9))]
    assert len(_copies(apart, pages)) == 2
    gap = [loads[0], ChunkLoad(_slot(arena, pages, 1), 0, range(6, 10))]
    assert len(_copies(gap, pages)) == 2
    turn = [loads[0], ChunkLoad(_slot(arena, pages, 1), 0, range(8, 4, -1))]
    assert len(_copies(turn, pages)) == 2
    back = [  # the second chunk's first block is where a run down from the first would be
        ChunkLoad(_slot(arena, pages, 0), 0, range(8, 12)),
        ChunkLoad(_slot(arena, pages, 1), 0, range(4, 0, -1)),
    ]
    assert len(_copies(back, pages)) == 2


def test_one_block_chunks_are_one_copy_counting_up_or_down() -> None:
    # The CPU's default: a chunk is one 128-token block; vLLM hands freed blocks out in
    # reverse, so adjacent slots often go to blocks counting down.
    pages = KVPages(make_pages(6)[0].layers, 1)
    arena, page = _arena(pages, 5, seed=6), pages.geometry.page_bytes
    down = [ChunkLoad(_slot(arena, pages, i), 0, (9 - i,)) for i in range(4)]
    up = [ChunkLoad(_slot(arena, pages, i), 0, (2 + i,)) for i in range(4)]
    assert [(c.chunks.shape, c.block, c.step) for c in _copies(down, pages)] == [
        ((4, 3, 1, page), 9, -1)
    ]
    assert [(c.chunks.shape, c.block, c.step) for c in _copies(up, pages)] == [
        ((4, 3, 1, page), 2, 1)
    ]
    turn = [*down[:2], ChunkLoad(_slot(arena, pages, 2), 0, (9,))]  # 9, 8, then 9: two runs
    assert [(c.block, c.step, c.chunks.shape[0]) for c in _copies(turn, pages)] == [
        (9, -1, 2),
        (9, 1, 1),
    ]


def test_offsets_join_chunks_as_their_addresses_do_and_are_checked() -> None:
    pages = KVPages(make_pages(7)[0].layers, 1)
    arena, n = _arena(pages, 4, seed=7), pages.geometry.chunk_bytes

    def load(slot: int, block: int, offset: int | None = None) -> ChunkLoad:
        return ChunkLoad(_slot(arena, pages, slot), 0, (block,), offset)

    def plan(loads: list[ChunkLoad]) -> list[tuple[Any, ...]]:
        return [
            (c.chunks.shape, c.block, c.step, address_of(c.chunks)) for c in _copies(loads, pages)
        ]

    by_offset = plan([load(i, 9 - i, i * n) for i in range(3)])
    assert by_offset == plan([load(i, 9 - i) for i in range(3)]) and len(by_offset) == 1
    assert len(plan([load(0, 9, 0), load(1, 8, 2 * n)])) == 2  # apart by their offsets
    # Offsets that join chunks lying apart would copy other memory: refused.
    with pytest.raises(ValueError, match="offsets"):
        _copies([load(0, 9, 0), load(2, 8, n)], pages)
    # A chunk without an offset: every chunk placed by its address.
    assert len(plan([load(0, 9, 5 * n), load(1, 8)])) == 1


@pytest.mark.parametrize("blocks_per_chunk", [1, BLOCKS_PER_CHUNK])
def test_a_span_of_chunks_loads_as_its_chunks_do_into_blocks_up_or_down(
    blocks_per_chunk: int,
) -> None:
    """``load_span``: whole chunks one after another in one view, into a run of blocks
    counting up or down, land where the chunks' own loads put them; blocks that are not
    one run (or not as many as the chunks have) are left to ``load``."""
    pages = KVPages(make_pages(8)[0].layers, blocks_per_chunk)
    arena, n = _arena(pages, 4, seed=8), pages.geometry.chunk_bytes
    num_blocks = 3 * blocks_per_chunk
    for ids in (tuple(range(num_blocks)), tuple(range(11, 11 - num_blocks, -1))):
        want = [layer.clone() for layer in pages.layers]
        reference = KVPages(want, blocks_per_chunk)
        for i in range(3):
            chunk = pages.chunk_tensor(_slot(arena, pages, 1 + i))
            reference.copy_chunk_in(
                chunk, 0, ids[i * blocks_per_chunk : (i + 1) * blocks_per_chunk]
            )
        mover = PageMover(pages, SyncStream(), gather="runs")
        events = mover.load_span(arena[n : 4 * n].toreadonly(), ids)
        assert events is not None
        events.synchronize()
        for got, expected in zip(pages.layers, want):
            assert torch.equal(got, expected)
    span = arena[n : 4 * n].toreadonly()
    gap = (*range(num_blocks - 1), num_blocks)
    assert PageMover(pages, SyncStream(), gather="runs").load_span(span, gap) is None
    short = tuple(range(num_blocks - 1))
    assert PageMover(pages, SyncStream(), gather="runs").load_span(span, short) is None


@pytest.mark.parametrize("offsets", [False, True], ids=["by-address", "by-offset"])
@pytest.mark.parametrize("seed", range(10))
def test_one_block_chunk_loads_match_the_page_by_page_reference(seed: int, offsets: bool) -> None:
    rng = random.Random(seed)
    pages = KVPages(make_pages(90 + seed)[0].layers, 1)
    want = [layer.clone() for layer in pages.layers]
    reference = KVPages(want, 1)
    arena = _arena(pages, 8, seed)
    slot, block, loads = rng.randrange(8), rng.randrange(SHAPE.num_blocks), []
    for _ in range(rng.randint(1, 10)):
        buffer = _slot(arena, pages, slot)
        offset = slot * pages.geometry.chunk_bytes if offsets else None
        loads.append(ChunkLoad(buffer, 0, (block,), offset))
        reference.copy_chunk_in(pages.chunk_tensor(buffer), 0, (block,))
        slot = (slot + 1) % 8 if rng.random() < 0.7 else rng.randrange(8)
        step = rng.choice([1, -1, 1, -1, 3])
        block = block + step if 0 <= block + step < SHAPE.num_blocks else rng.randrange(12)
    PageMover(pages, SyncStream(), gather="runs").load(loads).synchronize()
    for got, expected in zip(pages.layers, want):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("offsets", [False, True], ids=["by-address", "by-offset"])
@pytest.mark.parametrize("seed", range(20))
def test_host_loads_match_the_page_by_page_reference(seed: int, offsets: bool) -> None:
    """Random loads (whole and partial chunks, adjacent slots or not, consecutive or
    scattered blocks, buffers or tensors) land exactly where a page-by-page copy puts them."""
    rng = random.Random(seed)
    pages, _ = make_pages(10 + seed)
    want = [layer.clone() for layer in pages.layers]
    reference = KVPages(want, BLOCKS_PER_CHUNK)
    arena = _arena(pages, 6, seed)
    bpc, num_blocks = BLOCKS_PER_CHUNK, SHAPE.num_blocks
    slot, block, step = rng.randrange(6), 0, 1
    loads = []
    for _ in range(rng.randint(1, 8)):  # later loads may overwrite earlier ones' blocks
        kind = rng.random()
        if kind < 0.6:  # a whole chunk into consecutive blocks (up or down), often the next
            if rng.random() < 0.4 or not 0 <= block + step * (bpc - 1) < num_blocks:
                step = rng.choice([1, -1])
                block = rng.randint(0, num_blocks - bpc) + (0 if step > 0 else bpc - 1)
            first, ids = 0, list(range(block, block + step * bpc, step))
            block += step * bpc
        else:  # part of a chunk into blocks anywhere, or consecutive ones
            first = rng.randrange(bpc)
            n = rng.randint(1, bpc - first)
            ids = rng.sample(range(num_blocks), n)
            if kind < 0.8:
                ids = sorted(ids, reverse=rng.random() < 0.5)
        buffer = _slot(arena, pages, slot)
        src = pages.chunk_tensor(buffer) if rng.random() < 0.3 else buffer
        offset = slot * pages.geometry.chunk_bytes if offsets else None
        loads.append(ChunkLoad(src, first, ids, offset))
        reference.copy_chunk_in(pages.chunk_tensor(buffer), first, ids)
        slot = (slot + 1) % 6 if rng.random() < 0.6 else rng.randrange(6)
    PageMover(pages, SyncStream(), gather="runs").load(loads).synchronize()
    for got, expected in zip(pages.layers, want):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("seed", range(10))
def test_host_saves_match_the_page_by_page_reference(seed: int) -> None:
    """Whole chunks saved from blocks counting up, down or scattered, into adjacent slots
    or not, hold exactly what a page-by-page copy writes."""
    rng = random.Random(seed)
    pages, _ = make_pages(30 + seed)
    bpc, n = BLOCKS_PER_CHUNK, pages.geometry.chunk_bytes
    arena = memoryview(bytearray(6 * n))
    want = bytearray(6 * n)
    slots, saves = rng.sample(range(6), rng.randint(1, 6)), []
    if rng.random() < 0.5:
        slots.sort()
    block, step = 0, 1
    for slot in slots:
        kind = rng.random()
        if kind < 0.7:
            if rng.random() < 0.4 or not 0 <= block + step * (bpc - 1) < SHAPE.num_blocks:
                step = rng.choice([1, -1])
                block = rng.randint(0, SHAPE.num_blocks - bpc) + (0 if step > 0 else bpc - 1)
            ids = list(range(block, block + step * bpc, step))
            block += step * bpc
        else:
            ids = rng.sample(range(SHAPE.num_blocks), bpc)
        dst = arena[slot * n : (slot + 1) * n]
        saves.append(ChunkSave(ids, pages.chunk_tensor(dst)))
        pages.copy_chunk_out(ids, pages.chunk_tensor(memoryview(want)[slot * n : (slot + 1) * n]))
    PageMover(pages, SyncStream(), gather="runs").save(saves).synchronize()
    assert bytes(arena) == bytes(want)


@pytest.mark.parametrize(
    ("group_bytes", "unit_bytes"),
    [(0, 0), (20_000, 0), (1 << 30, 0), (1, 40_000)],
    ids=["by-layer", "2-layers", "all", "units-by-chunks"],
)
@pytest.mark.parametrize("seed", range(6))
def test_device_path_copies_match_the_page_by_page_reference(
    seed: int, group_bytes: int, unit_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA path's copies (gather="index": scratch, one copy per chunk and group of
    layers, scratch in batches) on CPU tensors: saves of whole chunks from scattered blocks,
    then loads into other scattered blocks, exactly as a page-by-page copy."""
    monkeypatch.setattr(mover_module, "SCRATCH_BYTES", 2 * 2 * BLOCKS_PER_CHUNK * 4096)
    rng = random.Random(seed)
    pages, _ = make_pages(50 + seed)
    assert pages.geometry.page_bytes == 4096  # 2 layers of a chunk: 32 KiB > 20,000
    bpc, n = BLOCKS_PER_CHUNK, pages.geometry.chunk_bytes
    num_chunks = rng.randint(1, SHAPE.num_blocks // bpc)
    src = rng.sample(range(SHAPE.num_blocks), bpc * num_chunks)
    arena = memoryview(bytearray(num_chunks * n))
    want = bytearray(num_chunks * n)
    saves = []
    for i in range(num_chunks):
        ids = src[i * bpc : (i + 1) * bpc]
        saves.append(ChunkSave(ids, pages.chunk_tensor(arena[i * n : (i + 1) * n])))
        pages.copy_chunk_out(ids, pages.chunk_tensor(memoryview(want)[i * n : (i + 1) * n]))
    mover = PageMover(
        pages, SyncStream(), gather="index", group_bytes=group_bytes, unit_bytes=unit_bytes
    )
    mover.save(saves).synchronize()
    assert bytes(arena) == bytes(want)

    dst, _ = make_pages(70 + seed)
    expected = [layer.clone() for layer in dst.layers]
    reference = KVPages(expected, bpc)
    to = rng.sample(range(SHAPE.num_blocks), bpc * num_chunks)
    loads = []
    for i in range(num_chunks):
        ids, chunk = to[i * bpc : (i + 1) * bpc], arena[i * n : (i + 1) * n]
        loads.append(ChunkLoad(chunk, 0, ids))
        reference.copy_chunk_in(pages.chunk_tensor(chunk), 0, ids)
    mover = PageMover(
        dst, SyncStream(), gather="index", group_bytes=group_bytes, unit_bytes=unit_bytes
    )
    events = mover.load(loads)
    assert len(events.events) == SHAPE.num_layers
    for got, wanted in zip(dst.layers, expected):
        assert torch.equal(got, wanted)


def test_layer_groups_are_runs_of_consecutive_layers_up_to_the_group_size() -> None:
    pages, _ = make_pages(0)  # 16 KiB per layer of a chunk
    mover = PageMover(pages, SyncStream(), gather="index", group_bytes=20_000, unit_bytes=0)
    assert mover._layer_groups(range(3)) == [[0, 1], [2]]
    assert mover._layer_groups([0, 2]) == [[0], [2]]
    by_layer = PageMover(pages, SyncStream(), group_bytes=1, unit_bytes=0)
    assert by_layer._layer_groups(range(3)) == [[0], [1], [2]]


def test_a_unit_holds_more_layers_when_a_copy_has_few_chunks() -> None:
    """``unit_bytes``: a unit moves at least that much of all its chunks together, so one
    chunk goes in fewer, larger units; many chunks keep ``group_bytes``'s groups."""
    pages, _ = make_pages(0)  # 16 KiB per layer of a chunk, 3 layers
    mover = PageMover(pages, SyncStream(), gather="index", group_bytes=1, unit_bytes=40_000)
    assert mover._layer_groups(range(3), num_chunks=1) == [[0, 1, 2]]  # 48 KiB >= 40,000
    assert mover._layer_groups(range(3), num_chunks=2) == [[0, 1], [2]]  # 64 KiB
    assert mover._layer_groups(range(3), num_chunks=3) == [[0], [1], [2]]  # 48 KiB each
    units = mover._units(1, range(3))
    assert [(u.group, u.batch, u.last) for u in units] == [([0, 1, 2], range(1), True)]


def test_device_gathers_move_8_byte_words_where_the_pages_allow() -> None:
    pages = torch.arange(4 * 16, dtype=torch.uint8).reshape(4, 16)
    words = mover_module._words(pages)
    assert words.dtype == torch.int64 and words.shape == (4, 2)
    assert words.data_ptr() == pages.data_ptr()  # the same memory
    odd = torch.zeros(4, 12, dtype=torch.uint8)  # 12-byte pages
    shifted = torch.zeros(65, dtype=torch.uint8)[1:].view(4, 16)  # not 8-byte aligned
    assert mover_module._words(odd) is odd and mover_module._words(shifted) is shifted


def test_a_chunk_buffer_of_the_wrong_size_is_refused() -> None:
    pages, _ = make_pages(5)
    short = memoryview(bytearray(pages.geometry.chunk_bytes - 1))
    with pytest.raises(ValueError, match="expected"):
        PageMover(pages, SyncStream()).load([ChunkLoad(short, 0, [0])])
    with pytest.raises(ValueError, match="expected"):
        PageMover(pages, SyncStream(), gather="index").load([ChunkLoad(short, 0, [0])])


def test_a_layer_subset_saves_only_those_layers() -> None:
    src, _ = make_pages(3)
    buf = bytearray(src.geometry.chunk_bytes)
    chunk = src.chunk_tensor(memoryview(buf))
    PageMover(src, SyncStream()).save([ChunkSave([5, 6, 7, 8], chunk)], layers=[1])
    assert not chunk[0].any() and not chunk[2].any()
    assert torch.equal(chunk[1], src.layers[1][5:9])


def test_cpu_tensors_get_the_synchronous_stream() -> None:
    assert isinstance(copy_stream_for(torch.device("cpu")), SyncStream)


# -- two processes, the real server, the shared arena ------------------------------------

NAMESPACE = namespace_for(SHAPE, "mover-test", SHAPE.block_size * BLOCKS_PER_CHUNK)
HASHES = chunk_hashes(NAMESPACE, list(range(3 * NAMESPACE.chunk_size)))[:2]
SAVED_BLOCKS = [[6, 1, 2, 3], [11, 0, 9, 8]]

STORE_SCRIPT = """
import sys
from lmcache_svc.client import CacheClient
from lmcache_svc_vllm.mover import ChunkSave, PageMover
from lmcache_svc_vllm.streams import SyncStream
from tests.vllm.test_mover import HASHES, NAMESPACE, SAVED_BLOCKS, make_pages

pages, _ = make_pages(seed=7)
with CacheClient(sys.argv[1]) as client:
    ns = client.register_namespace(NAMESPACE)
    slots = client.prepare_store(ns, HASHES)
    assert [s.status for s in slots] == ["reserved", "reserved"], slots
    saves = [ChunkSave(b, pages.chunk_tensor(s.buffer)) for b, s in zip(SAVED_BLOCKS, slots)]
    PageMover(pages, SyncStream(), gather=sys.argv[2]).save(saves).synchronize()
    assert client.commit_store(ns, HASHES) == 2
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    proc = start_server(tmp_path_factory.mktemp("mover"))
    yield proc
    proc.cleanup()


@pytest.mark.parametrize("gather", ["index", "runs"])
def test_bytes_stored_by_one_process_load_identically_in_another(
    server: ServerProc, gather: str
) -> None:
    with CacheClient(server.socket) as client:
        ns = client.register_namespace(NAMESPACE)
        client.delete(ns, HASHES)
        env = {"PYTHONPATH": f"{REPO}:{REPO / 'connectors' / 'vllm'}", "PATH": "/usr/bin:/bin"}
        subprocess.run(
            [sys.executable, "-c", textwrap.dedent(STORE_SCRIPT), server.socket, gather],
            cwd=REPO,
            env=env,
            check=True,
            timeout=60,
        )
        src, _ = make_pages(seed=7)  # the storing process's values, regenerated
        dst, _ = make_pages(seed=8)
        lease = client.prepare_load(ns, HASHES)
        assert len(lease.buffers) == 2 and all(b.readonly for b in lease.buffers)
        loads = [ChunkLoad(dst.chunk_tensor(b), 0, [4, 5, 6, 7][::-1]) for b in lease.buffers[:1]]
        loads.append(ChunkLoad(dst.chunk_tensor(lease.buffers[1]), 1, [10, 2, 3]))
        PageMover(dst, SyncStream(), gather=gather).load(loads).synchronize()  # type: ignore[arg-type]
        client.release_load(lease)
    for s, d in zip(src.layers, dst.layers):
        for got, want in [(7, 6), (6, 1), (5, 2), (4, 3), (10, 0), (2, 9), (3, 8)]:
            assert bytes(d[got].numpy()) == bytes(s[want].numpy())

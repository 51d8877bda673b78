"""GPU check: the plugin's CUDA copies and the HBM tier on a real device, then benchmarks.

    python -m tests.gpu.check [--gib 1]        (or scripts/gpu_check.sh)

Needs only a CUDA build of torch and this repository (no server, no vLLM, no network).

1. Two processes through the shared arena: this process creates the arena and the slots;
   a second one builds KV caches laid out exactly like vLLM 0.32's on CUDA (``LBNHC``,
   ``kv_layout.py``), saves chunks into the slots with ``PageMover`` on its copy stream;
   this process loads them into other blocks of its own CUDA KV and checks every byte.
2. The HBM tier across two processes: this process fills an ``HbmTier`` on the device and
   hands its CUDA IPC handle (protobuf bytes, no pickle) to a second process, which maps
   the pool, copies a chunk device to device and checks its bytes.
3. Benchmarks, each next to its same-run baseline (GB/s, median of ``--repeats``):
   D2H and H2D through the arena (page-locked by ``HostPinner``) vs a plain pinned torch
   copy of the same bytes; pageable vs pinned; the arena before and after registration;
   registration time; the HBM tier's device-to-device copy vs a plain device copy.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "connectors" / "vllm"))

from lmcache_svc_vllm.layout import KVPages  # noqa: E402
from lmcache_svc_vllm.mover import (  # noqa: E402
    GROUP_BYTES,
    UNIT_BYTES,
    ChunkLoad,
    ChunkSave,
    PageMover,
)
from lmcache_svc_vllm.pinning import HostPinner, address_of, cuda_host_registrar  # noqa: E402
from lmcache_svc_vllm.streams import CudaCopyStream, copy_stream_for  # noqa: E402

from lmcache_svc.keys import ChunkKey  # noqa: E402
from lmcache_svc.shm.arena import Arena, ArenaMapping  # noqa: E402
from lmcache_svc.tiers.cuda_ipc import CudaIpcHandle, open_handle  # noqa: E402
from lmcache_svc.tiers.hbm import DevicePool, HbmTier  # noqa: E402
from tests.gpu.kv_layout import KVShape, make_kv_caches, page_order  # noqa: E402

SHAPE = KVShape(num_layers=8, num_blocks=256, block_size=16, num_kv_heads=8, head_size=128)
BLOCKS_PER_CHUNK = 16  # 256-token chunks
SAVED = [[(7 * i + 3 * c) % SHAPE.num_blocks for i in range(BLOCKS_PER_CHUNK)] for c in range(4)]
LOADED = [list(range(100 + 16 * c, 116 + 16 * c))[::-1] for c in range(4)]
DEVICE = "cuda"  # "cpu" only for --cpu-dry-run of the two-process arena check (CI, no GPU)


def make_pages(seed: int, shape: KVShape = SHAPE) -> KVPages:
    caches = make_kv_caches(shape, seed=seed, device=DEVICE)
    return KVPages.from_kv_caches(
        caches,
        num_blocks=shape.num_blocks,
        blocks_per_chunk=BLOCKS_PER_CHUNK,
        page_order=page_order(shape),
    )


# -- 1. two processes through the arena --------------------------------------------------


def check_arena_round_trip() -> None:
    chunk_bytes = make_pages(0).geometry.chunk_bytes
    arena = Arena.create(8 * chunk_bytes, slab_bytes=chunk_bytes, prefault="sync")
    try:
        slots = [arena.allocate(chunk_bytes) for _ in SAVED]
        offsets = [s.offset for s in slots if s is not None]
        args = [arena.name, str(arena.segment_size), arena.nonce.hex(), *map(str, offsets)]
        _child("store", args)
        src, dst = make_pages(seed=7), make_pages(seed=8)  # seed 7: the child's values
        loads = [
            ChunkLoad(dst.chunk_tensor(arena.view(s)), 0, ids)
            for s, ids in zip(slots, LOADED)
            if s is not None
        ]
        PageMover(dst, copy_stream_for(torch.device(DEVICE))).load(loads).synchronize()
        del loads  # views of the arena: released before it closes
        for s_layer, d_layer in zip(src.layers, dst.layers):
            for saved, loaded in zip(SAVED, LOADED):
                assert torch.equal(d_layer[loaded].cpu(), s_layer[saved].cpu()), "bytes differ"
    finally:
        arena.close()
    print("arena round trip across two processes (vLLM 0.32 CUDA layout LBNHC): bytes identical")


def _store_child(name: str, size: str, nonce: str, *offsets: str) -> None:
    mapping = ArenaMapping.open(name, int(size), bytes.fromhex(nonce))
    assert mapping is not None, "could not map the arena"
    pages = make_pages(seed=7)
    n = pages.geometry.chunk_bytes
    saves = [
        ChunkSave(ids, pages.chunk_tensor(mapping.view(int(off), n)))
        for ids, off in zip(SAVED, offsets)
    ]
    PageMover(pages, copy_stream_for(torch.device(DEVICE))).save(saves).synchronize()


# -- 2. the HBM tier across two processes ------------------------------------------------


def check_hbm_ipc() -> None:
    chunk = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8).numpy().tobytes()
    tier = HbmTier(DevicePool.allocate(8 << 20, 0), slab_bytes=1 << 20)
    key = ChunkKey(b"\x07" * 48)
    assert tier.put(key, chunk) and tier.put(ChunkKey(b"\x08" * 48), chunk[::-1])
    slot = tier.slot_of(key)
    assert slot is not None
    wire = tier.export_handle().to_proto().SerializeToString()
    expected = torch.frombuffer(bytearray(chunk), dtype=torch.uint8).sum().item()
    _child("hbm", [wire.hex(), str(slot.offset), str(slot.length), str(expected)])
    tier.close()
    print("HBM tier over CUDA IPC across two processes: bytes identical")


def _hbm_child(wire: str, offset: str, length: str, expected: str) -> None:
    from lmcache_svc.v1 import device_pb2

    handle = CudaIpcHandle.from_proto(device_pb2.CudaIpcHandle.FromString(bytes.fromhex(wire)))
    pool = open_handle(handle)
    local = torch.empty(int(length), dtype=torch.uint8, device="cuda")
    local.copy_(pool[int(offset) : int(offset) + int(length)])  # device to device
    assert local.sum().item() == int(expected), "HBM bytes differ"


def _child(role: str, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "tests.gpu.check", "--device", DEVICE, "--child", role, *args]
    subprocess.run(cmd, cwd=REPO, check=True, timeout=300)


# -- 3. benchmarks -----------------------------------------------------------------------


def _rate(nbytes: int, fn: Callable[[], object], repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def benchmarks(gib: float, repeats: int) -> None:
    shape = KVShape(
        num_layers=32,
        num_blocks=max(16, int(gib * (1 << 30)) // (32 * KVShape().page_bytes)),
        block_size=16,
        num_kv_heads=8,
        head_size=128,
    )
    pages = make_pages(1, shape)
    g = pages.geometry
    num_chunks = shape.num_blocks // BLOCKS_PER_CHUNK
    nbytes = num_chunks * g.chunk_bytes
    print(
        f"\ndevice: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{nbytes / 2**30:.2f} GiB per copy, {g.num_layers} layers, {g.page_bytes} B pages"
    )
    arena = Arena.create(nbytes + g.chunk_bytes, slab_bytes=g.chunk_bytes, prefault="sync")
    slots = [arena.allocate(g.chunk_bytes) for _ in range(num_chunks)]
    order = torch.randperm(shape.num_blocks).tolist()  # scattered blocks, as in a real cache
    ids = [order[c * BLOCKS_PER_CHUNK : (c + 1) * BLOCKS_PER_CHUNK] for c in range(num_chunks)]
    saves = [ChunkSave(b, pages.chunk_tensor(arena.view(s))) for b, s in zip(ids, slots) if s]
    loads = [ChunkLoad(c.dst, 0, b) for c, b in zip(saves, ids)]
    mover = PageMover(pages, CudaCopyStream("cuda"))
    d2h = lambda: mover.save(saves).synchronize()  # noqa: E731
    h2d = lambda: mover.load(loads).synchronize()  # noqa: E731
    arena_pageable = (_rate(nbytes, d2h, repeats), _rate(nbytes, h2d, repeats))

    pinner = HostPinner(*cuda_host_registrar())
    start = time.perf_counter()
    first = slots[0]
    assert first is not None
    pinner.add_buffer(arena.view(first))  # the whole mapping behind the slots
    pinner.wait_idle()
    register_s = time.perf_counter() - start
    arena_pinned = (_rate(nbytes, d2h, repeats), _rate(nbytes, h2d, repeats))
    _verify_round_trip(pages, saves, loads)
    by_layer = PageMover(pages, CudaCopyStream("cuda"), group_bytes=0)  # before grouping
    arena_by_layer = (
        _rate(nbytes, lambda: by_layer.save(saves).synchronize(), repeats),
        _rate(nbytes, lambda: by_layer.load(loads).synchronize(), repeats),
    )
    variants = _mover_variants(pages, saves, loads, nbytes, repeats)

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    arena_one_copy = _one_copy_rates(arena.view(first).obj, first.offset, dev, repeats)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)
    plain = {
        "pinned": (
            _rate(nbytes, lambda: pinned.copy_(dev, non_blocking=True), repeats),
            _rate(nbytes, lambda: dev.copy_(pinned, non_blocking=True), repeats),
        ),
        "pageable": (
            _rate(nbytes, lambda: pageable.copy_(dev), repeats),
            _rate(nbytes, lambda: dev.copy_(pageable), repeats),
        ),
    }
    print(
        f"registering the {arena.segment_size / 2**30:.2f} GiB arena: {register_s:.2f} s "
        f"({len(pinner.registered)} parts, in the background)"
    )
    for i, what in enumerate(("D2H", "H2D")):
        a, p = arena_pinned[i], plain["pinned"][i]
        print(
            f"{what}: arena (pinned) {a:.1f} GB/s vs plain pinned torch copy {p:.1f} GB/s "
            f"= {100 * a / p:.0f}% (target >= 90%); copying layer by layer "
            f"{arena_by_layer[i]:.1f} GB/s; one plain copy to/from the registered arena "
            f"{arena_one_copy[i]:.1f} GB/s; arena before registration "
            f"{arena_pageable[i]:.1f} GB/s; plain pageable {plain['pageable'][i]:.1f} GB/s"
        )
    for (overlap, group, stack), (d2h_rate, h2d_rate) in variants.items():
        print(
            f"  the mover, gathers and scatters {'beside' if overlap else 'between'} the "
            f"copies, {'a group of layers' if stack else 'a layer'} at a time, "
            f"{group >> 20} MiB per chunk and copy: D2H {d2h_rate:.1f} GB/s "
            f"({100 * d2h_rate / plain['pinned'][0]:.0f}%), H2D {h2d_rate:.1f} GB/s "
            f"({100 * h2d_rate / plain['pinned'][1]:.0f}%)"
        )
    pinner.close()
    saves.clear()  # views of the arena: released before it closes
    loads.clear()
    arena.close()
    _bench_hbm(pages, ids, repeats)


def _verify_round_trip(pages: KVPages, saves: list[ChunkSave], loads: list[ChunkLoad]) -> None:
    """After the timed copies: every slot holds its blocks' pages, and a load into other
    blocks of fresh KV puts them there (many units of scratch, both streams at work)."""
    for c in saves:
        ids = torch.tensor(list(c.block_ids), device="cuda")
        want = torch.stack([layer.index_select(0, ids) for layer in pages.layers])
        assert torch.equal(c.dst.to("cuda"), want), "a saved slot differs from its blocks"
    fresh = KVPages([torch.zeros_like(layer) for layer in pages.layers], BLOCKS_PER_CHUNK)
    PageMover(fresh, CudaCopyStream("cuda")).load(loads).synchronize()
    blocks = torch.tensor([b for c in loads for b in c.block_ids], device="cuda")
    for got, want_layer in zip(fresh.layers, pages.layers):
        same = torch.equal(got.index_select(0, blocks), want_layer.index_select(0, blocks))
        assert same, "a loaded block differs from the saved one"
    print("1 GiB saved and loaded back through the page-locked arena: bytes identical")


def _mover_variants(
    pages: KVPages,
    saves: list[ChunkSave],
    loads: list[ChunkLoad],
    nbytes: int,
    repeats: int,
) -> dict[tuple[bool, int, bool], tuple[float, float]]:
    """D2H and H2D rates of the mover with its gathers and scatters beside the copies (on
    the side stream) or between them, copies of 4 MiB, 16 MiB or whole chunks, and the
    layers of a group gathered and scattered together or one by one (between, 4 MiB, one
    by one: the mover before these options)."""
    chunk = pages.geometry.chunk_bytes
    rates = {}
    for overlap, group, stack in (
        (True, GROUP_BYTES, True),
        (True, 4 * GROUP_BYTES, True),
        (True, chunk, True),
        (True, GROUP_BYTES, False),
        (False, GROUP_BYTES, False),
        (False, chunk, False),
    ):
        m = PageMover(
            pages, CudaCopyStream("cuda"), group_bytes=group, overlap=overlap, stack_layers=stack
        )
        rates[(overlap, group, stack)] = (
            _rate(nbytes, lambda: m.save(saves).synchronize(), repeats),  # noqa: B023
            _rate(nbytes, lambda: m.load(loads).synchronize(), repeats),  # noqa: B023
        )
    return rates


def bench_small_loads(repeats: int) -> None:
    """The fixed cost of a hit on the device: loads of 1, 2, 4 and 16 chunks of 128 tokens
    (the plugin's default on CUDA: 8 blocks of 16) of a model shaped like an 8B one (32
    layers, 8 KV heads of 128, bf16: 16 MiB a chunk) from the page-locked arena into
    scattered blocks, next to one plain pinned copy of the same bytes; and the host time
    ``load`` takes to enqueue them (what the forward pass's thread spends). Each variant's
    loaded blocks are checked against their chunks."""
    shape = KVShape(num_layers=32, num_blocks=512, block_size=16, num_kv_heads=8, head_size=128)
    bpc = 8
    caches = make_kv_caches(shape, seed=4, device="cuda")
    pages = KVPages.from_kv_caches(
        caches, num_blocks=shape.num_blocks, blocks_per_chunk=bpc, page_order=page_order(shape)
    )
    g = pages.geometry
    most = 16
    arena = Arena.create(most * g.chunk_bytes, slab_bytes=g.chunk_bytes, prefault="sync")
    slots = [arena.allocate(g.chunk_bytes) for _ in range(most)]
    first = slots[0]
    assert first is not None and all(s is not None for s in slots)
    pinner = HostPinner(*cuda_host_registrar())
    pinner.add_buffer(arena.view(first))
    pinner.wait_idle()
    for s in slots:  # something to load, to check each variant's bytes by
        assert s is not None
        pages.chunk_tensor(arena.view(s)).copy_(
            torch.randint(0, 256, (g.chunk_bytes,)).view(g.num_layers, bpc, g.page_bytes)
        )
    order = torch.randperm(shape.num_blocks).tolist()
    variants = (
        (True, UNIT_BYTES, f"a group of layers at a time, units of {UNIT_BYTES >> 20} MiB"),
        (True, 0, "a group of layers at a time, a unit per 4 MiB group (before units)"),
        (False, UNIT_BYTES, "a layer at a time"),
    )
    for n, (stack, unit_bytes, what) in itertools.product((1, 2, 4, 16), variants):
        mover = PageMover(pages, CudaCopyStream("cuda"), stack_layers=stack, unit_bytes=unit_bytes)
        loads = [
            ChunkLoad(arena.view(s), 0, order[i * bpc : (i + 1) * bpc])
            for i, s in enumerate(slots[:n])
            if s is not None
        ]
        load_ms, enqueue_ms, copy_ms = _time_load(mover, loads, arena.view(first), repeats)
        for c in loads:
            want = pages.chunk_tensor(c.src).to("cuda")  # type: ignore[arg-type]
            got = torch.stack([layer[c.block_ids] for layer in pages.layers])
            assert torch.equal(got, want), f"{what}: a loaded block differs from its chunk"
        print(
            f"a hit of {n} chunk(s) ({n * bpc * shape.block_size} tokens, "
            f"{n * g.chunk_bytes >> 20} MiB), {what}: load {load_ms:.3f} ms (enqueued in "
            f"{enqueue_ms:.3f} ms) vs one plain pinned copy {copy_ms:.3f} ms: "
            f"{load_ms - copy_ms:+.3f} ms"
        )
        loads.clear()  # views of the arena: released before it closes
    pinner.close()
    arena.close()


def _time_load(
    mover: PageMover, loads: list[ChunkLoad], first: memoryview, repeats: int
) -> tuple[float, float, float]:
    """Milliseconds (medians): the whole load, the host's time to enqueue it, and one
    plain pinned copy of the same number of bytes from the arena's first slots."""
    nbytes = len(loads) * mover.pages.geometry.chunk_bytes
    start_at = first.obj  # the whole mapping: the slots lie one after another
    offset = np.frombuffer(first, dtype=np.uint8).ctypes.data - address_of(start_at)
    host = torch.frombuffer(start_at, dtype=torch.uint8)[offset : offset + nbytes]
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    enqueue: list[float] = []

    def load() -> None:
        start = time.perf_counter()
        events = mover.load(loads)
        enqueue.append(time.perf_counter() - start)
        events.synchronize()

    load_s = nbytes / _rate(nbytes, load, repeats) / 1e9
    copy_s = nbytes / _rate(nbytes, lambda: dev.copy_(host, non_blocking=True), repeats) / 1e9
    return 1e3 * load_s, 1e3 * statistics.median(enqueue), 1e3 * copy_s


def _one_copy_rates(
    mapping: object, offset: int, dev: torch.Tensor, repeats: int
) -> tuple[float, float]:
    """One copy of ``dev``'s bytes to and from the registered arena at ``offset`` (D2H, H2D):
    what its memory allows (page-locked 4 KiB pages) without the mover's per-chunk copies.
    (The tensor over the mapping is gone when this returns, so the arena can close.)"""
    n = dev.numel()
    region = torch.frombuffer(mapping, dtype=torch.uint8)[offset : offset + n]
    return (
        _rate(n, lambda: region.copy_(dev, non_blocking=True), repeats),
        _rate(n, lambda: dev.copy_(region, non_blocking=True), repeats),
    )


def _bench_hbm(pages: KVPages, ids: list[list[int]], repeats: int) -> None:
    """An HBM hit into scattered KV blocks: straight from the pool (one scatter per chunk,
    the default on a device) and through the load path's scratch, next to a plain device
    copy and one plain scatter (``index_copy_`` of 8-byte words) of the same bytes; the
    direct load's bytes are checked."""
    g = pages.geometry
    pool = DevicePool.allocate(len(ids) * g.chunk_bytes, 0)
    tier = HbmTier(pool, slab_bytes=g.chunk_bytes)
    pattern = np.random.default_rng(0).integers(0, 256, g.chunk_bytes, dtype=np.uint8)
    keys = [ChunkKey(i.to_bytes(48, "little")) for i in range(len(ids))]
    for i, key in enumerate(keys):  # every chunk and page different
        assert tier.put(key, np.roll(pattern, 4099 * i).tobytes())
    # the pool's own tensor: the same device memory an engine maps through the IPC handle
    # (CUDA cannot open an IPC handle in the process that exported it; check_hbm_ipc does
    # that in a second process)
    slots = [tier.slot_of(k) for k in keys]
    views = [pool.buffer[s.offset : s.offset + s.length] for s in slots if s is not None]
    loads = [
        ChunkLoad(v.view(g.num_layers, g.blocks_per_chunk, g.page_bytes), 0, b)
        for v, b in zip(views, ids)
    ]
    nbytes = len(ids) * g.chunk_bytes
    rates = {}
    apart = loads[::-1]  # each chunk's slot before the last one's: a scatter per chunk
    for what, direct, order in (("run", True, loads), ("apart", True, apart), ("", False, loads)):
        mover = PageMover(pages, CudaCopyStream("cuda"), direct=direct)
        rates[what] = _rate(nbytes, lambda: mover.load(order).synchronize(), repeats)  # noqa: B023
        for c in loads:
            got = torch.stack([layer[c.block_ids] for layer in pages.layers])
            assert torch.equal(got, c.src), "an HBM hit's block differs from its chunk"
            for layer in pages.layers:  # so the next variant's check sees its own bytes
                layer[c.block_ids] = 0
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    plain = _rate(nbytes, lambda: b.copy_(a), repeats)
    words = a.view(torch.int64).view(-1, g.page_bytes // 8)
    into = torch.empty(2 * words.shape[0], words.shape[1], dtype=torch.int64, device="cuda")
    rows = torch.randperm(into.shape[0], device="cuda")[: words.shape[0]]
    scatter = _rate(nbytes, lambda: into.index_copy_(0, rows, words), repeats)
    print(
        f"HBM tier hit (device to device into KV blocks) vs plain device copy {plain:.0f} "
        f"GB/s: straight from the pool, chunks one after another there (one scatter) "
        f"{rates['run']:.0f} GB/s = {100 * rates['run'] / plain:.0f}%, chunks apart (a "
        f"scatter per chunk) {rates['apart']:.0f} GB/s = {100 * rates['apart'] / plain:.0f}%, "
        f"through scratch {rates['']:.0f} GB/s = {100 * rates[''] / plain:.0f}%; one plain "
        f"scatter of the same pages {scatter:.0f} GB/s"
    )
    tier.close()


def probe_straddling() -> None:
    """What the driver does with a copy across two registrations, and across a registered
    range and a pageable one (why ``HostPinner`` registers a mapping whole)."""
    import mmap

    from lmcache_svc_vllm.pinning import address_of

    part, n = 16 << 20, 2 << 20
    mm = mmap.mmap(-1, 3 * part)
    base = address_of(mm)
    register, unregister = cuda_host_registrar()
    register(base, part, False)
    register(base + part, part, False)
    host = torch.frombuffer(mm, dtype=torch.uint8)
    dev = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    for what, start in (("two registrations", part), ("registered | pageable", 2 * part)):
        span = host[start - n // 2 : start + n // 2]
        try:
            span.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            outcome = "bytes identical" if torch.equal(span, dev.cpu()) else "BYTES DIFFER"
        except Exception as e:  # noqa: BLE001  (the probe reports what the driver says)
            outcome = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        print(f"copy device to host across {what}: {outcome}")
    del span, host
    unregister(base)
    unregister(base + part)
    mm.close()


def bench_registration(gib: float) -> None:
    """Page-locking an arena of ``gib``: the time to the first registered part (copies are
    pinned from then on for that part), to all of them, and to unregister them."""
    arena = Arena.create(int(gib * (1 << 30)), slab_bytes=64 << 20, prefault="sync")
    try:
        slot = arena.allocate(64 << 20)
        assert slot is not None
        pinner = HostPinner(*cuda_host_registrar())
        start = time.perf_counter()
        pinner.add_buffer(arena.view(slot))
        while not pinner.registered:
            time.sleep(0.001)
        first_s = time.perf_counter() - start
        pinner.wait_idle()
        all_s = time.perf_counter() - start
        parts = len(pinner.registered)
        start = time.perf_counter()
        pinner.close()
        close_s = time.perf_counter() - start
        print(
            f"registering a {arena.segment_size / 2**30:.1f} GiB arena ({parts} part) on the "
            f"background thread: {all_s:.2f} s (first part {first_s:.2f} s); unregistering at "
            f"shutdown {close_s:.2f} s"
        )
    finally:
        arena.close()


def bench_layer_waits(repeats: int, group_bytes: int) -> None:
    """How long a forward pass waits for its loads: each layer waiting for its own copies
    (``wait_on_device(layer)``) vs one wait for all of them before the first layer, with
    per-layer compute about as long as a layer's copy; the compute alone is the baseline."""
    shape = KVShape(num_layers=32, num_blocks=128, block_size=16, num_kv_heads=8, head_size=128)
    pages = make_pages(2, shape)
    g = pages.geometry
    num_chunks = shape.num_blocks // BLOCKS_PER_CHUNK
    source = torch.empty((num_chunks, g.chunk_bytes), dtype=torch.uint8, pin_memory=True)
    ids = [list(range(c * BLOCKS_PER_CHUNK, (c + 1) * BLOCKS_PER_CHUNK)) for c in range(num_chunks)]
    loads = [
        ChunkLoad(source[c].view(g.num_layers, g.blocks_per_chunk, g.page_bytes), 0, ids[c])
        for c in range(num_chunks)
    ]
    mover = PageMover(pages, CudaCopyStream("cuda"), group_bytes=group_bytes)
    layer_bytes = num_chunks * g.blocks_per_chunk * g.page_bytes
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def forward(wait: Callable[[int], None]) -> None:
        for i in range(g.num_layers):
            wait(i)
            torch.mm(a, a)

    def timed(run: Callable[[], None]) -> float:
        run()
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            run()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        return statistics.median(times)

    def layerwise() -> None:
        events = mover.load(loads)
        forward(events.wait_on_device)

    def one_wait() -> None:
        events = mover.load(loads)
        events.wait_on_device(g.num_layers - 1)
        forward(lambda i: None)

    compute = timed(lambda: forward(lambda i: None))
    copies = timed(lambda: mover.load(loads).wait_on_device(g.num_layers - 1))
    per_layer, all_first = timed(layerwise), timed(one_wait)
    copy_mib = (group_bytes or g.blocks_per_chunk * g.page_bytes) >> 20
    print(
        f"layer waits, {g.num_layers} layers, {layer_bytes / 2**20:.0f} MiB loaded per layer "
        f"(pinned; copies of {copy_mib} MiB per chunk): compute alone {compute:.2f} ms, "
        f"the copies alone {copies:.2f} ms; "
        f"forward with layer-wise waits {per_layer:.2f} ms (waited {per_layer - compute:.2f}), "
        f"with one wait for all {all_first:.2f} ms (waited {all_first - compute:.2f})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="bytes per benchmark copy")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument(
        "--register-gib", type=float, default=16.0, help="arena size for the registration time"
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument(
        "--device", default="cuda", help="cpu: dry-run of the arena check only (no GPU)"
    )
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if args.child:
        role, *rest = args.child
        children: dict[str, Callable[..., None]] = {"store": _store_child, "hbm": _hbm_child}
        children[role](*rest)
        return 0
    if DEVICE == "cpu":
        check_arena_round_trip()
        return 0
    if not torch.cuda.is_available():
        print("needs CUDA (not available here)", file=sys.stderr)
        return 2
    check_arena_round_trip()
    check_hbm_ipc()
    probe_straddling()
    if not args.skip_bench:
        benchmarks(args.gib, args.repeats)
        bench_small_loads(args.repeats)
        for group_bytes in (0, GROUP_BYTES):
            bench_layer_waits(args.repeats, group_bytes)
        bench_registration(args.register_gib)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Batched per-layer copies (``mover.py``) on CPU tensors laid out like vLLM 0.32's CUDA KV
cache (LBNHC), through the synchronous stream seam; across two processes and a real server."""

# ruff: noqa: E402  (imports after the torch check)
from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the layout code needs torch (the [torch] extra)")
import torch
from lmcache_svc_vllm.layout import KVPages, runs_of
from lmcache_svc_vllm.mover import ChunkLoad, ChunkSave, PageMover
from lmcache_svc_vllm.streams import SyncStream, copy_stream_for

from lmcache_svc.client import CacheClient
from lmcache_svc.keys import KVLayout, Namespace, chunk_hashes
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.gpu.kv_layout import KVShape, make_kv_caches, page_order

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

NAMESPACE = Namespace(
    model="mover-test",
    layout=KVLayout(
        "bfloat16",
        SHAPE.num_layers,
        SHAPE.num_kv_heads,
        SHAPE.head_size,
        SHAPE.block_size,
        "vllm-cuda/BNHC",
    ),
    chunk_size=SHAPE.block_size * BLOCKS_PER_CHUNK,
)
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

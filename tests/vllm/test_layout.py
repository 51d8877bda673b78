"""KV pages <-> chunk bytes, on the CPU layout and on CUDA's (emulated with strides)."""

# ruff: noqa: E402  (imports after the torch check)
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the layout code needs torch (the [torch] extra)")
import torch
from lmcache_svc_vllm.layout import (
    KVPages,
    UnsupportedLayout,
    check_page_order,
    layer_sort_key,
    page_layout_label,
    page_order_from_layout_name,
    page_view,
)

from tests.cuda_marks import requires_cuda

B, H, N, C = 6, 2, 4, 8  # blocks, KV heads, tokens per block, K+V contents


def kv_tensor(
    page_order: str, seed: int = 0, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logical [B, H, N, C] view, the physical tensor behind it) for a page order."""
    gen = torch.Generator().manual_seed(seed)
    sizes = {"B": B, "H": H, "N": N, "C": C}
    physical = torch.randn([sizes[a] for a in page_order], generator=gen).to(torch.bfloat16)
    physical = physical.to(device)
    logical = physical.permute([page_order.index(a) for a in "BHNC"])
    return logical, physical


def test_layout_names_map_to_page_orders() -> None:
    assert page_order_from_layout_name("LBHNC") == "BHNC"  # CPU backend
    assert page_order_from_layout_name("LBNHC") == "BNHC"  # CUDA / FlashAttention
    assert page_order_from_layout_name("BLHNC") == "BHNC"  # block-outer cross-layer
    assert page_layout_label("cpu", "BHNC") == "vllm-cpu/BHNC"
    with pytest.raises(UnsupportedLayout):
        page_order_from_layout_name("LBHNX")


@pytest.mark.parametrize("page_order", ["BHNC", "BNHC"])
def test_a_page_is_the_physical_bytes_of_one_block(page_order: str) -> None:
    logical, physical = kv_tensor(page_order)
    pages = page_view(logical, B, page_order)
    assert pages.shape == (B, H * N * C * 2)
    for block in range(B):
        assert torch.equal(pages[block], physical[block].contiguous().view(torch.uint8).flatten())


def test_cpu_and_cuda_orders_are_told_apart() -> None:
    cpu_kv, _ = kv_tensor("BHNC")
    cuda_kv, _ = kv_tensor("BNHC")
    check_page_order(cpu_kv, "BHNC")
    check_page_order(cuda_kv, "BNHC")
    with pytest.raises(UnsupportedLayout, match="not in the BHNC layout"):
        check_page_order(cuda_kv, "BHNC")
    with pytest.raises(UnsupportedLayout, match="not in the BNHC layout"):
        check_page_order(cpu_kv, "BNHC")


def test_head_outer_layouts_are_refused() -> None:
    logical, _ = kv_tensor("HBNC")
    with pytest.raises(UnsupportedLayout, match="not contiguous"):
        page_view(logical, B, "HBNC")


def test_split_kernel_blocks_fold_into_scheduler_blocks() -> None:
    logical, physical = kv_tensor("BHNC")  # 6 kernel blocks = 3 scheduler blocks of 2
    pages = page_view(logical, B // 2, "BHNC")
    assert pages.shape == (B // 2, 2 * H * N * C * 2)
    assert torch.equal(pages[1], physical[2:4].contiguous().view(torch.uint8).flatten())


def test_layers_sort_naturally() -> None:
    names = ["model.layers.10.attn", "model.layers.2.attn", "model.layers.1.attn"]
    assert sorted(names, key=layer_sort_key) == [names[2], names[1], names[0]]


def make_pages(page_order: str, device: str = "cpu") -> tuple[KVPages, list[torch.Tensor]]:
    layers = {f"layers.{i}.attn": kv_tensor(page_order, seed=i, device=device) for i in range(3)}
    pages = KVPages.from_kv_caches(
        {name: logical for name, (logical, _) in layers.items()},
        num_blocks=B,
        blocks_per_chunk=2,
        page_order=page_order,
    )
    return pages, [physical for _, physical in layers.values()]


@pytest.mark.parametrize("page_order", ["BHNC", "BNHC"])
def test_chunk_bytes_are_layer_major_then_block(page_order: str) -> None:
    pages, physical = make_pages(page_order)
    buffer = memoryview(bytearray(pages.geometry.chunk_bytes))
    pages.copy_chunk_out([4, 1], pages.chunk_tensor(buffer))
    page_bytes = pages.geometry.page_bytes
    for layer in range(3):
        for j, block in enumerate([4, 1]):
            offset = (layer * 2 + j) * page_bytes
            expected = physical[layer][block].contiguous().view(torch.uint8).flatten()
            assert bytes(buffer[offset : offset + page_bytes]) == bytes(expected.numpy())


@pytest.mark.parametrize("page_order", ["BHNC", "BNHC"])
def test_round_trip_restores_blocks_elsewhere(page_order: str) -> None:
    src, _ = make_pages(page_order)
    dst, dst_physical = make_pages(page_order)
    for t in dst_physical:
        t.zero_()
    buffer = memoryview(bytearray(src.geometry.chunk_bytes))
    src.copy_chunk_out([4, 1], src.chunk_tensor(buffer))
    dst.copy_chunk_in(dst.chunk_tensor(buffer), 0, [0, 5])
    for s, d in zip(src.layers, dst.layers):
        assert torch.equal(d[0], s[4]) and torch.equal(d[5], s[1])
        assert not d[[1, 2, 3, 4]].any()


def test_partial_chunk_load_copies_only_its_tail() -> None:
    src, _ = make_pages("BHNC")
    dst, dst_physical = make_pages("BHNC")
    for t in dst_physical:
        t.zero_()
    buffer = memoryview(bytearray(src.geometry.chunk_bytes))
    src.copy_chunk_out([2, 3], src.chunk_tensor(buffer))
    dst.copy_chunk_in(dst.chunk_tensor(buffer), 1, [5])  # the chunk's second block only
    for s, d in zip(src.layers, dst.layers):
        assert torch.equal(d[5], s[3])
        assert not d[:5].any()


def test_wrong_size_buffer_is_refused() -> None:
    pages, _ = make_pages("BHNC")
    with pytest.raises(ValueError, match="expected"):
        pages.chunk_tensor(memoryview(bytearray(pages.geometry.chunk_bytes - 1)))


@requires_cuda
def test_cuda_round_trip_stages_through_host() -> None:
    src, _ = make_pages("BNHC", device="cuda")
    dst, dst_physical = make_pages("BNHC", device="cuda")
    for t in dst_physical:
        t.zero_()
    buffer = memoryview(bytearray(src.geometry.chunk_bytes))
    src.copy_chunk_out([4, 1], src.chunk_tensor(buffer))
    dst.copy_chunk_in(dst.chunk_tensor(buffer), 0, [0, 5])
    for s, d in zip(src.layers, dst.layers):
        assert torch.equal(d[0], s[4]) and torch.equal(d[5], s[1])


def test_read_only_load_buffer_is_copied_in_without_warning_or_copy(tmp_path: Path) -> None:
    # Load leases hand out read-only views (PROT_READ mapping). torch warns once per process,
    # so the check runs in a fresh interpreter with warnings as errors.
    code = textwrap.dedent(
        f"""
        import mmap, numpy as np, torch
        from tests.vllm.test_layout import make_pages
        src, _ = make_pages("BHNC")
        dst, dst_physical = make_pages("BHNC")
        for t in dst_physical:
            t.zero_()
        n = src.geometry.chunk_bytes
        path = {str(tmp_path / "chunk")!r}
        with open(path, "w+b") as f:
            f.truncate(n)
            rw = mmap.mmap(f.fileno(), n)
            src.copy_chunk_out([4, 1], src.chunk_tensor(memoryview(rw)))
            ro = memoryview(mmap.mmap(f.fileno(), n, prot=mmap.PROT_READ))
        assert ro.readonly
        tensor = dst.chunk_tensor(ro)
        assert tensor.data_ptr() == np.frombuffer(ro, dtype=np.uint8).ctypes.data  # no copy
        dst.copy_chunk_in(tensor, 0, [0, 5])
        for s, d in zip(src.layers, dst.layers):
            assert torch.equal(d[0], s[4]) and torch.equal(d[5], s[1])
        print("ok")
        """
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "connectors/vllm"), str(root)])}
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr

"""KV pages <-> chunk bytes.

vLLM 0.32 hands a connector one tensor per attention layer, a logical ``[B, H, N, C]`` view
(blocks, KV heads, tokens of a block, K and V contents) whose *physical* order is a named
layout: ``BHNC`` on the CPU backend (``LBHNC``), ``BNHC`` under FlashAttention on CUDA
(``LBNHC``). Either way the bytes of one block of one layer -- a *page* -- are one
contiguous run; we copy pages as opaque bytes and put the physical order (and the device
kind) in the key namespace, so a page is only ever restored into an identical layout.

Chunk bytes, the unit the server stores: for each layer (in natural layer-name order), for
each block of the chunk (in token order), that block's page. As a tensor:
``[num_layers, blocks_per_chunk, page_bytes]`` of uint8.

Between CPU and CUDA only two things differ: the page order (a different label, so the
two never share chunks, and a different stride check), and the copy direction: the same
``copy_`` calls are memcpys on the CPU and device<->host transfers on CUDA (synchronous
from pageable memory, so a save is ordered after the forward pass that wrote the KV).
Copies go run by run of consecutive block ids: one contiguous copy per run and layer.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

_AXES = "BHNC"


class UnsupportedLayout(ValueError):
    """A KV tensor whose pages we cannot copy as contiguous byte runs."""


def page_order_from_layout_name(layout_name: str) -> str:
    """vLLM's model-wide layout name (e.g. ``LBHNC``) -> the per-layer page order."""
    order = layout_name.upper().replace("L", "")
    if sorted(order) != sorted(_AXES):
        raise UnsupportedLayout(f"unknown KV cache layout {layout_name!r}")
    return order


def page_layout_label(device_type: str, page_order: str) -> str:
    """The namespace's ``page_layout``: device kind and per-layer page order."""
    return f"vllm-{device_type}/{page_order}"


def layer_sort_key(name: str) -> list[int | str]:
    """Natural order of layer names (``layers.10`` after ``layers.9``)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def check_page_order(kv: torch.Tensor, page_order: str) -> int:
    """Check that a logical ``[B, H, N, C]`` view is laid out as ``page_order`` with dense
    pages (blocks outermost); returns the elements of one page."""
    if kv.ndim != 4:
        raise UnsupportedLayout(f"expected a 4-D [B, H, N, C] KV view, got shape {tuple(kv.shape)}")
    if page_order[0] != "B":
        raise UnsupportedLayout(f"KV pages are not contiguous in layout {page_order!r}")
    expected = 1
    for axis in reversed(page_order[1:]):
        d = _AXES.index(axis)
        if kv.shape[d] > 1 and kv.stride(d) != expected:
            raise UnsupportedLayout(
                f"KV tensor of shape {tuple(kv.shape)} and strides {kv.stride()} is not "
                f"in the {page_order} layout with dense pages"
            )
        expected *= kv.shape[d]
    if kv.shape[0] > 1 and kv.stride(0) < expected:
        raise UnsupportedLayout(f"KV pages overlap (strides {kv.stride()})")
    return expected


def page_view(kv: torch.Tensor, num_blocks: int, page_order: str) -> torch.Tensor:
    """uint8 ``[num_blocks, page_bytes]`` view of one layer's KV tensor (shares memory).

    ``num_blocks`` is the scheduler's block count; a kernel that splits each block into
    several smaller kernel blocks (``kv.shape[0]`` a multiple of it) is folded back, as long
    as the kernel blocks of one block are adjacent.
    """
    kernel_page_elems = check_page_order(kv, page_order)
    if kv.shape[0] % num_blocks:
        raise UnsupportedLayout(f"{kv.shape[0]} kernel blocks for {num_blocks} blocks")
    ratio = kv.shape[0] // num_blocks
    if ratio > 1 and kv.stride(0) != kernel_page_elems:
        raise UnsupportedLayout("split kernel blocks are not adjacent")
    el = kv.element_size()
    flat = torch.empty(0, dtype=torch.uint8, device=kv.device)
    flat.set_(
        kv.untyped_storage(),
        kv.storage_offset() * el,
        (num_blocks, ratio * kernel_page_elems * el),
        (ratio * kv.stride(0) * el, 1),
    )
    return flat


@dataclass(frozen=True, slots=True)
class ChunkGeometry:
    num_layers: int
    blocks_per_chunk: int
    page_bytes: int

    @property
    def chunk_bytes(self) -> int:
        return self.num_layers * self.blocks_per_chunk * self.page_bytes


class KVPages:
    """The engine's KV tensors as per-layer page views, and chunk copies in and out."""

    def __init__(self, layers: Sequence[torch.Tensor], blocks_per_chunk: int) -> None:
        if not layers:
            raise UnsupportedLayout("no KV layers")
        self.layers = list(layers)
        page_bytes = {p.shape[1] for p in self.layers}
        if len(page_bytes) != 1:
            raise UnsupportedLayout(f"layers have different page sizes: {sorted(page_bytes)}")
        self.device = self.layers[0].device
        self.geometry = ChunkGeometry(len(self.layers), blocks_per_chunk, page_bytes.pop())

    @classmethod
    def from_kv_caches(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        num_blocks: int,
        blocks_per_chunk: int,
        page_order: str,
    ) -> KVPages:
        names = sorted(kv_caches, key=layer_sort_key)
        views = [page_view(kv_caches[n], num_blocks, page_order) for n in names]
        return cls(views, blocks_per_chunk)

    def chunk_tensor(self, buffer: memoryview) -> torch.Tensor:
        """A chunk buffer (shared segment or bytes) as ``[layers, blocks, page]`` uint8, sharing
        its memory. Load buffers are read-only views: torch has no read-only tensors and
        warns, so the warning is silenced for them; the tensor is only read (copied in)."""
        g = self.geometry
        if len(buffer) != g.chunk_bytes:
            raise ValueError(f"chunk buffer of {len(buffer)} bytes, expected {g.chunk_bytes}")
        if not len(buffer):
            flat = torch.empty(0, dtype=torch.uint8)
        elif buffer.readonly:  # a leased chunk: only ever a copy source, never written
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "The given buffer is not writable")
                flat = torch.frombuffer(buffer, dtype=torch.uint8)
        else:
            flat = torch.frombuffer(buffer, dtype=torch.uint8)
        return flat.view(g.num_layers, g.blocks_per_chunk, g.page_bytes)

    def copy_chunk_out(self, block_ids: Sequence[int], dst: torch.Tensor) -> None:
        """Gather the pages of a full chunk's blocks into ``dst`` (a chunk tensor)."""
        for start, block, n in runs_of(block_ids):
            for layer, out in zip(self.layers, dst):
                out[start : start + n].copy_(layer[block : block + n])

    def copy_chunk_in(self, src: torch.Tensor, first_block: int, block_ids: Sequence[int]) -> None:
        """Scatter blocks ``first_block ..`` of a chunk tensor into the given KV blocks."""
        for start, block, n in runs_of(block_ids):
            part = src[:, first_block + start : first_block + start + n]
            for layer, pages in zip(self.layers, part):
                layer[block : block + n].copy_(pages)


def runs_of(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position, first block id, length) of each run of consecutive block ids: one
    contiguous memcpy per run and layer (``index_copy_`` is ~3x slower on the CPU). The
    plugin's one run splitter: ``mover.py`` copies by these runs too."""
    runs: list[tuple[int, int, int]] = []
    for pos, block in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((pos, block, 1))
    return runs

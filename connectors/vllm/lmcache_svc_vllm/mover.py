"""Batched KV copies between the engine's pages and chunk slots, one layer at a time.

``PageMover`` moves the pages of one step's chunks layer by layer on a ``CopyStream``:

- save (device -> slot): for each layer, the pages of every chunk of the step are gathered
  with one ``index_select`` into a scratch tensor on the KV's device (one kernel), then one
  copy per chunk writes that layer's pages straight into the chunk's slot (a device-to-host
  DMA on CUDA; into the mapped shared segment, no host staging buffer);
- load (slot -> device): one copy per chunk brings that layer's pages from the slot into a
  device scratch tensor, then one ``index_copy_`` scatters them into the blocks.

A chunk whose blocks are one run of consecutive ids needs no scratch (its pages are one
contiguous range of the layer): ``gather="runs"`` copies run by run instead, which is what
the CPU uses (an extra memcpy through scratch costs more there than per-run calls). On the
CPU those copies are numpy slice assignments over the same memory: a copy of one page costs
a few microseconds, and torch's per-call overhead was most of it (a 2,688-token load of
the tiny test model: 0.21 ms against 0.47-0.52 ms, memcpy of the same bytes 0.13 ms).

Every layer ends with an event: a load's forward pass waits (on the device) only for the
layer it is about to run (``LayerEvents.wait_on_device``); a save's caller waits for the
last layer before it publishes the slots. The scratch tensors are made and used on the copy
stream only, so torch's caching allocator never hands their memory to other work early.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from lmcache_svc_vllm.layout import KVPages, runs_of
from lmcache_svc_vllm.streams import CopyEvent, CopyStream, SyncStream

Gather = Literal["runs", "index"]


@dataclass(frozen=True, slots=True)
class ChunkSave:
    """Save one chunk: the pages of ``block_ids`` into ``dst`` (a ``[layers, blocks, page]``
    chunk tensor over its slot)."""

    block_ids: Sequence[int]
    dst: torch.Tensor


@dataclass(frozen=True, slots=True)
class ChunkLoad:
    """Load blocks ``first_block ..`` of the chunk tensor ``src`` into ``block_ids``."""

    src: torch.Tensor
    first_block: int
    block_ids: Sequence[int]


class LayerEvents:
    """One event per layer of a load or save, in layer order."""

    def __init__(self, events: Sequence[CopyEvent]) -> None:
        self.events = list(events)

    def wait_on_device(self, layer: int) -> None:
        self.events[layer].wait_on_device()

    def synchronize(self) -> None:
        if self.events:
            self.events[-1].synchronize()  # one stream: the last event follows all others


class PageMover:
    def __init__(self, pages: KVPages, stream: CopyStream, *, gather: Gather | None = None) -> None:
        self.pages = pages
        self.stream = stream
        device = pages.device
        self.gather: Gather = gather or ("index" if device.type != "cpu" else "runs")
        self._non_blocking = device.type != "cpu"
        # On the CPU, numpy views of the same memory: a numpy slice copy costs about 1.5 us
        # of overhead against torch's 5-7 us, which is most of a small page's copy time.
        # (Synchronous copies only: another stream is a device's, or a test's recording one.)
        host = device.type == "cpu" and isinstance(stream, SyncStream)
        self._host = _numpy_views(pages.layers) if host else None

    # -- saves ---------------------------------------------------------------------------

    def save(self, chunks: Sequence[ChunkSave], layers: Sequence[int] | None = None) -> LayerEvents:
        """Enqueue the saves of ``layers`` (default: all), after the compute stream's work."""
        self.stream.follow_current()
        todo = range(len(self.pages.layers)) if layers is None else layers
        if self._host is not None and self.gather == "runs":
            return LayerEvents(self._save_host(todo, chunks) or [self.stream.record()])
        with self.stream.activate():
            events = [self._save_layer(i, chunks) for i in todo]
        # With no layer left (all saved layer by layer), the event still marks the copies
        # enqueued before: the caller's synchronize() waits for them before committing.
        return LayerEvents(events or [self.stream.record()])

    def _save_host(self, layers: Sequence[int], chunks: Sequence[ChunkSave]) -> list[CopyEvent]:
        assert self._host is not None
        plans = [(c.dst.numpy(), runs_of(c.block_ids)) for c in chunks]
        events = []
        for layer in layers:
            kv = self._host[layer]
            for dst, runs in plans:
                for start, block, n in runs:
                    dst[layer, start : start + n] = kv[block : block + n]
            events.append(self.stream.record())
        return events

    def _save_layer(self, layer: int, chunks: Sequence[ChunkSave]) -> CopyEvent:
        kv = self.pages.layers[layer]
        nb = self._non_blocking
        if self.gather == "runs" or all(_is_run(c.block_ids) for c in chunks):
            for c in chunks:
                for start, block, n in runs_of(c.block_ids):
                    c.dst[layer, start : start + n].copy_(kv[block : block + n], non_blocking=nb)
            return self.stream.record()
        ids = [b for c in chunks for b in c.block_ids]
        gathered = kv.index_select(0, torch.tensor(ids, dtype=torch.long, device=kv.device))
        offset = 0
        for c in chunks:
            n = len(c.block_ids)
            c.dst[layer, :n].copy_(gathered[offset : offset + n], non_blocking=nb)
            offset += n
        return self.stream.record()

    # -- loads ---------------------------------------------------------------------------

    def load(self, chunks: Sequence[ChunkLoad]) -> LayerEvents:
        """Enqueue the loads of every layer; wait per layer with ``wait_on_device``."""
        self.stream.follow_current()  # blocks being overwritten are not read meanwhile
        if self._host is not None and self.gather == "runs":
            return LayerEvents(self._load_host(chunks))
        with self.stream.activate():
            return LayerEvents([self._load_layer(i, chunks) for i in range(len(self.pages.layers))])

    def _load_host(self, chunks: Sequence[ChunkLoad]) -> list[CopyEvent]:
        assert self._host is not None
        plans = [(c.src.numpy(), c.first_block, runs_of(c.block_ids)) for c in chunks]
        events = []
        for layer, kv in enumerate(self._host):
            for src, first_block, runs in plans:
                for start, block, n in runs:
                    first = first_block + start
                    kv[block : block + n] = src[layer, first : first + n]
            events.append(self.stream.record())
        return events

    def _load_layer(self, layer: int, chunks: Sequence[ChunkLoad]) -> CopyEvent:
        kv = self.pages.layers[layer]
        nb = self._non_blocking
        if self.gather == "runs" or all(_is_run(c.block_ids) for c in chunks):
            for c in chunks:
                for start, block, n in runs_of(c.block_ids):
                    first = c.first_block + start
                    kv[block : block + n].copy_(c.src[layer, first : first + n], non_blocking=nb)
            return self.stream.record()
        ids = [b for c in chunks for b in c.block_ids]
        staged = torch.empty((len(ids), kv.shape[1]), dtype=torch.uint8, device=kv.device)
        offset = 0
        for c in chunks:
            n = len(c.block_ids)
            staged[offset : offset + n].copy_(
                c.src[layer, c.first_block : c.first_block + n], non_blocking=nb
            )
            offset += n
        kv.index_copy_(0, torch.tensor(ids, dtype=torch.long, device=kv.device), staged)
        return self.stream.record()


def _numpy_views(layers: Sequence[torch.Tensor]) -> list[np.ndarray] | None:
    """numpy arrays over the layers' memory; None (copy with torch) where torch refuses."""
    try:
        return [kv.numpy() for kv in layers]
    except (RuntimeError, TypeError):
        return None


def _is_run(block_ids: Sequence[int]) -> bool:
    return len(runs_of(block_ids)) <= 1

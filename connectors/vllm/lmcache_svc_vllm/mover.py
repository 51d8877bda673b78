"""Batched KV copies between the engine's pages and chunk slots, one layer at a time.

``PageMover`` moves the pages of one step's chunks on a ``CopyStream``; on a device, whole
chunks go by groups of consecutive layers (``_layer_groups``: 4 MiB of a chunk per copy, and
16 MiB of all the chunks together where there are few),
a group for a batch of chunks at a time (a unit, ``_units``):

- save (device -> slot): the pages of every chunk of the unit are gathered into device
  scratch (one ``index_select`` per layer, or one for the group where the layers share a
  buffer: ``_StackedLayers``), then one copy per chunk writes the group's pages straight
  into the chunk's slot (a device-to-host DMA on CUDA; into the mapped shared segment, no
  host staging buffer);
- load (slot -> device): one copy per chunk brings the group's pages from the slot into
  device scratch, then one ``index_copy_`` per layer (or per group) scatters them into
  the blocks.

The gathers and scatters run on the stream's side stream, beside the copies: the units
take turns with two scratch buffers, and each hand-over between the streams waits for an
event (on an H100 this took the arena's copies from 85-88% of a plain pinned copy to
88-95%; a short load's host time halved with a gather or scatter per group: docs/gpu.md).
Gathers and scatters move 8-byte words, and nothing waits on the host (on an H100 these
took the arena's copies from 68-75% of a plain pinned copy to 86-88%).
A load that starts inside a chunk (vLLM holds its first blocks) goes layer by layer, all
its chunks (a chunk whose blocks are one run of consecutive ids without scratch).
``gather="runs"`` copies run by run instead, which is what the CPU uses (an extra memcpy
through scratch costs more there than per-run calls). On the CPU the copies are numpy
assignments over the same memory (torch's per-call overhead was most of a page's copy
time), as few as the chunks' places allow (``_host_copies``): whole
chunks in consecutive slots of the arena paired with consecutive blocks -- counting up, or
down as vLLM hands out freed blocks -- are one strided copy per layer, whatever their
number. A 6,016-token load of the tiny test model (47 chunks, 4 layers) is 4 copies, was
188 slice copies and 47 chunk tensors: 1.3 -> 0.66 ms in a micro-measurement with a small
destination, memcpy's time; inside an engine, whose blocks were last touched long ago,
the memory sets the pace either way (about half a warm memcpy's: ``docs/benchmarks.md``).
Given a ``copier``, a big load that the forward pass waits for layer by layer copies on
that thread, beside the forward pass (``copy_thread.py``).

Every layer ends with an event (on a device, once its group is in place): a load's forward
pass waits (on the device) only for the layer it is about to run
(``LayerEvents.wait_on_device``); a save's caller waits for the last layer before it
publishes the slots. The scratch tensors are made on the copy stream, and the copy
stream's later work is ordered after every use of them on the side stream, so torch's
caching allocator never hands their memory to other work early.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Literal

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from lmcache_svc_vllm.copy_thread import CopyThread
from lmcache_svc_vllm.layout import ChunkGeometry, KVPages, runs_of
from lmcache_svc_vllm.streams import CopyEvent, CopyStream, SyncStream

Gather = Literal["runs", "index"]

GROUP_BYTES = 4 << 20
"""Device copies of whole chunks move at least this much per chunk where layers allow."""
UNIT_BYTES = 16 << 20
"""A unit of a grouped copy moves at least this much, all its chunks together, where the
layers allow: a group then holds more layers when a load or save has few chunks. Each unit
costs the host its copies, a gather or scatter, events and stream switches to enqueue; a
128-token hit of an 8B model (one 16 MiB chunk) was 4 units of 4 MiB, and enqueueing them
took longer than the copy itself (docs/gpu.md). At most half of ``SCRATCH_BYTES``."""
SCRATCH_BYTES = 256 << 20
"""The most device scratch a grouped copy holds at a time (its two buffers together)."""
COPIER_MIN_BYTES = 4 << 20
"""CPU loads of less than this copy in the caller even with a copier (the plugin's default
``tuning.overlap_load_min_bytes``: a hand-over costs more than a small load's copy)."""


@dataclass(frozen=True, slots=True)
class ChunkSave:
    """Save one chunk: the pages of ``block_ids`` into ``dst`` (a ``[layers, blocks, page]``
    chunk tensor over its slot)."""

    block_ids: Sequence[int]
    dst: torch.Tensor


@dataclass(slots=True)
class ChunkLoad:
    """Load blocks ``first_block ..`` of the chunk ``src`` into ``block_ids``: a chunk
    tensor, or the chunk's bytes (a shared segment's view), which the mover turns into
    whatever its copies need. ``offset``: where ``src`` starts in the segment it views,
    the same segment for every chunk of the load (None: unknown), which tells chunks that
    lie one after another there without asking each for its address (``_host_copies``).

    Not frozen: a hit makes one per chunk, and a frozen dataclass sets each field through
    a call (47 of them took 40 us, against 11)."""

    src: torch.Tensor | memoryview
    first_block: int
    block_ids: Sequence[int]
    offset: int | None = None


class LayerEvents:
    """One event per layer of a load or save, in layer order."""

    def __init__(self, events: Sequence[CopyEvent]) -> None:
        self.events = list(events)

    def wait_on_device(self, layer: int) -> None:
        self.events[layer].wait_on_device()

    def synchronize(self) -> None:
        if self.events:
            self.events[-1].synchronize()  # one stream: the last event follows all others

    def done(self) -> bool:
        """True when every layer's copies are done (CPU copies in the caller: at once)."""
        return all(event.query() for event in self.events)


class PageMover:
    def __init__(
        self,
        pages: KVPages,
        stream: CopyStream,
        *,
        gather: Gather | None = None,
        group_bytes: int = GROUP_BYTES,
        unit_bytes: int = UNIT_BYTES,
        overlap: bool = True,
        stack_layers: bool = True,
        copier: CopyThread | None = None,
        copier_min_bytes: int = COPIER_MIN_BYTES,
        direct: bool | None = None,
    ) -> None:
        """``group_bytes``: device copies of whole chunks move this many bytes per chunk
        where the layers allow (``_layer_groups``); 0 copies layer by layer.
        ``unit_bytes``: and a group of layers holds at least this many bytes of all the
        chunks together (0: ``group_bytes`` alone sets its size). ``overlap``:
        their gathers and scatters run on the stream's side stream, beside the copies
        (False: on the copy stream, between them). ``stack_layers``: layers that lie in one
        buffer at even distances are gathered and scattered a group at a time
        (``_StackedLayers``; False: one layer at a time). ``copier`` (CPU): loads of at
        least ``copier_min_bytes`` that the forward pass waits for layer by layer copy on it,
        beside the forward pass (``copy_thread.py``); None: every copy in the caller.
        ``direct``: whole chunks whose bytes are on the KV's device already (the HBM tier's
        pool) load by one scatter per chunk straight from them, where the layers share a
        buffer (``_load_direct``); None: on a device, not on the CPU."""
        self.pages = pages
        self.stream = stream
        self._side = stream.side() if overlap else stream
        self._stacked = _StackedLayers.of(pages) if stack_layers else None
        self.group_bytes = group_bytes
        self.unit_bytes = unit_bytes
        device = pages.device
        self.gather: Gather = gather or ("index" if device.type != "cpu" else "runs")
        self._non_blocking = device.type != "cpu"
        # On the CPU, numpy views of the same memory: a numpy slice copy costs about 1.5 us
        # of overhead against torch's 5-7 us, which is most of a small page's copy time.
        # (Synchronous copies only: another stream is a device's, or a test's recording one.)
        host = device.type == "cpu" and isinstance(stream, SyncStream)
        self._host = _numpy_views(pages.layers) if host else None
        self._copier = copier if self._host is not None else None
        self.copier_min_bytes = copier_min_bytes
        self._direct = device.type != "cpu" if direct is None else direct

    # -- saves ---------------------------------------------------------------------------

    def save(self, chunks: Sequence[ChunkSave], layers: Sequence[int] | None = None) -> LayerEvents:
        """Enqueue the saves of ``layers`` (default: all), after the compute stream's work."""
        self.stream.follow_current()
        todo = range(len(self.pages.layers)) if layers is None else layers
        if self._host is not None and self.gather == "runs":
            return LayerEvents(self._save_host(todo, chunks) or [self.stream.record()])
        if todo and self._groups_whole(chunks, 0):
            events = self._save_grouped(todo, chunks)
        else:
            with self.stream.activate():
                gather = self._gather_ids(chunks)
                events = [self._save_layer(i, chunks, gather) for i in todo]
        # With no layer left (all saved layer by layer), the event still marks the copies
        # enqueued before: the caller's synchronize() waits for them before committing.
        return LayerEvents(events or [self.stream.record()])

    def _save_host(self, layers: Sequence[int], chunks: Sequence[ChunkSave]) -> list[CopyEvent]:
        assert self._host is not None
        places = [(c.dst, 0, c.block_ids, None) for c in chunks]
        copies = _host_copies(places, self.pages.geometry, writeable=True)
        events = []
        for layer in layers:
            kv = self._host[layer]
            for copy in copies:
                copy.out_of(kv, layer)
            events.append(self.stream.record())
        return events

    def _save_layer(
        self, layer: int, chunks: Sequence[ChunkSave], ids: torch.Tensor | None
    ) -> CopyEvent:
        """``ids``: the chunks' block ids to gather, or None: copy each chunk's runs."""
        kv = self.pages.layers[layer]
        nb = self._non_blocking
        if ids is None:
            for c in chunks:
                for start, block, n in runs_of(c.block_ids):
                    c.dst[layer, start : start + n].copy_(kv[block : block + n], non_blocking=nb)
            return self.stream.record()
        gathered = _words(kv).index_select(0, ids).view(torch.uint8)
        offset = 0
        for c in chunks:
            n = len(c.block_ids)
            c.dst[layer, :n].copy_(gathered[offset : offset + n], non_blocking=nb)
            offset += n
        return self.stream.record()

    # -- loads ---------------------------------------------------------------------------

    def load(self, chunks: Sequence[ChunkLoad], *, beside: bool = False) -> LayerEvents:
        """Enqueue the loads of every layer; wait per layer with ``wait_on_device``.
        ``beside`` (CPU, with a ``copier``): a load the forward pass waits for layer by layer,
        which may copy on the copier."""
        self.stream.follow_current()  # blocks being overwritten are not read meanwhile
        if self._host is not None and self.gather == "runs":
            return LayerEvents(self._load_host(chunks, beside))
        srcs = [self._chunk_tensor(c.src) for c in chunks]
        layers = range(len(self.pages.layers))
        if self._groups_whole(chunks, max((c.first_block for c in chunks), default=0)):
            runs = self._direct_runs(srcs)
            if runs is not None:
                return LayerEvents(self._load_direct(chunks, runs))
            return LayerEvents(self._load_grouped(layers, chunks, srcs))
        with self.stream.activate():
            gather = self._gather_ids(chunks)
            return LayerEvents([self._load_layer(i, chunks, srcs, gather) for i in layers])

    def _direct_runs(self, srcs: Sequence[torch.Tensor]) -> list[tuple[int, torch.Tensor]] | None:
        """For ``_load_direct``: the chunks' runs in words (``_runs_in_words``), or None
        when a chunk is not on the KV's device, in words of the KV's rows."""
        stacked = self._stacked
        if not self._direct or stacked is None:
            return None
        return _runs_in_words(srcs, self.pages.device, stacked.words)

    def _load_direct(
        self, chunks: Sequence[ChunkLoad], runs: Sequence[tuple[int, torch.Tensor]]
    ) -> list[CopyEvent]:
        """Chunks on the KV's device already: one scatter per run of chunks that lie one
        after another in memory (else per chunk), all their layers, straight from their
        bytes into their blocks, on the copy stream (after the forward pass's queued work:
        ``load`` follows it); every layer's event once all are in. Through scratch, each
        4 MiB group of a chunk cost the host a copy, a scatter and events to enqueue, which
        held a device-to-device load of 1 GiB to 10-19% of a plain device copy on an H100
        and an H200; the host's time per scatter is what limits this path too."""
        assert self._stacked is not None
        layers = list(range(len(self.pages.layers)))
        units = [_Unit(layers, range(first, first + len(run)), True) for first, run in runs]
        ids = self._unit_ids(chunks, units)
        with self.stream.activate():
            for rows, (_, run) in zip(ids, runs):
                self._stacked.scatter(rows, run)
            done = self.stream.record()
        return [done] * len(layers)

    def load_span(
        self, span: memoryview, block_ids: Sequence[int], *, beside: bool = False
    ) -> LayerEvents | None:
        """``load`` of the whole chunks that lie one after another in ``span``, in order,
        into blocks that follow one another (up, or down as vLLM hands out freed blocks):
        one copy a layer, planned with no Python per chunk (``_host_copies`` took 0.14 ms
        of a cold 47-chunk load); None on another path or other blocks (then ``load``)."""
        g = self.pages.geometry
        if self._host is None or self.gather != "runs" or span.nbytes % g.chunk_bytes:
            return None
        num_chunks = span.nbytes // g.chunk_bytes
        ids = block_ids if type(block_ids) is tuple else tuple(block_ids)
        step = _direction(ids)
        if step is None or len(ids) != num_chunks * g.blocks_per_chunk:
            return None
        self.stream.follow_current()  # blocks being overwritten are not read meanwhile
        shape = (num_chunks, g.num_layers, g.blocks_per_chunk, g.page_bytes)
        copy = _HostCopy(_host_bytes(span).reshape(shape), ids[0], step)
        return LayerEvents(self._copy_host([copy], beside))

    def _load_host(self, chunks: Sequence[ChunkLoad], beside: bool) -> list[CopyEvent]:
        places = [(c.src, c.first_block, c.block_ids, c.offset) for c in chunks]
        return self._copy_host(_host_copies(places, self.pages.geometry, writeable=False), beside)

    def _copy_host(self, copies: Sequence[_HostCopy], beside: bool) -> list[CopyEvent]:
        """Planned by the caller, before any copy: on the copy thread the plan's Python held
        the interpreter lock that the forward pass, starting beside it, needs."""
        assert self._host is not None
        host = self._host

        def copy_layer(layer: int) -> None:
            for copy in copies:
                copy.into(host[layer], layer)

        num_bytes = sum(copy.layer_bytes for copy in copies) * len(host)
        if beside and self._copier is not None and num_bytes >= self.copier_min_bytes:
            # Copied while the forward pass runs up to each layer's attention.
            return list(self._copier.copy_layers(copy_layer, range(len(host))))
        events: list[CopyEvent] = []
        for layer in range(len(host)):
            copy_layer(layer)
            events.append(self.stream.record())
        return events

    def _chunk_tensor(self, chunk: torch.Tensor | memoryview) -> torch.Tensor:
        return chunk if isinstance(chunk, torch.Tensor) else self.pages.chunk_tensor(chunk)

    def _load_layer(
        self,
        layer: int,
        chunks: Sequence[ChunkLoad],
        srcs: Sequence[torch.Tensor],
        ids: torch.Tensor | None,
    ) -> CopyEvent:
        """``ids``: the chunks' block ids to scatter to, or None: copy each chunk's runs."""
        kv = self.pages.layers[layer]
        nb = self._non_blocking
        if ids is None:
            for c, src in zip(chunks, srcs):
                for start, block, n in runs_of(c.block_ids):
                    first = c.first_block + start
                    kv[block : block + n].copy_(src[layer, first : first + n], non_blocking=nb)
            return self.stream.record()
        staged = torch.empty((len(ids), kv.shape[1]), dtype=torch.uint8, device=kv.device)
        offset = 0
        for c, src in zip(chunks, srcs):
            n = len(c.block_ids)
            staged[offset : offset + n].copy_(
                src[layer, c.first_block : c.first_block + n], non_blocking=nb
            )
            offset += n
        _words(kv).index_copy_(0, ids, _words(staged))
        return self.stream.record()

    # -- device copies of whole chunks, layers grouped --------------------------------------

    def _groups_whole(self, chunks: Sequence[ChunkSave] | Sequence[ChunkLoad], first: int) -> bool:
        """Group layers: a device copy path of scattered blocks, whole chunks only."""
        bpc = self.pages.geometry.blocks_per_chunk
        return (
            self.gather == "index"
            and self.group_bytes > 0
            and bool(chunks)
            and first == 0
            and all(len(c.block_ids) == bpc for c in chunks)
        )

    def _layer_groups(self, layers: Sequence[int], num_chunks: int = 1) -> list[list[int]]:
        """Runs of consecutive layers whose pages of one chunk add up to ``group_bytes``,
        and whose pages of all ``num_chunks`` chunks to ``unit_bytes``: each chunk's part of
        a group is one contiguous range of its slot, one copy. (A chunk's pages of one layer
        are 512 KiB for a typical 8B model's 128-token chunk; a copy that small leaves the
        copy engine idle between launches, and a unit that small costs the host more to
        enqueue than its copies take.)"""
        g = self.pages.geometry
        per_layer = g.blocks_per_chunk * g.page_bytes  # one chunk's pages of one layer
        size = max(
            1,
            -(-self.group_bytes // per_layer),
            -(-self.unit_bytes // (max(1, num_chunks) * per_layer)),
        )
        groups: list[list[int]] = []
        for layer in layers:
            if groups and groups[-1][-1] + 1 == layer and len(groups[-1]) < size:
                groups[-1].append(layer)
            else:
                groups.append([layer])
        return groups

    def _units(self, num_chunks: int, layers: Sequence[int]) -> list[_Unit]:
        """The grouped copies in order: each group of layers, its chunks in batches of at
        most one scratch buffer (``SCRATCH_BYTES``, or half of it each where two buffers
        take turns)."""
        g = self.pages.geometry
        budget = SCRATCH_BYTES if self._side is self.stream else SCRATCH_BYTES // 2
        units = []
        for group in self._layer_groups(layers, num_chunks):
            per_chunk = len(group) * g.blocks_per_chunk * g.page_bytes
            step = max(1, budget // per_chunk)
            for i in range(0, num_chunks, step):
                last = i + step >= num_chunks
                units.append(_Unit(group, range(i, min(i + step, num_chunks)), last))
        return units

    def _scratch(self, units: Sequence[_Unit]) -> list[torch.Tensor]:
        """The device scratch the units take turns with: two buffers, so the side stream
        fills or drains one while the copy stream moves the other (one where both are the
        same stream). Made on the copy stream: whatever reuses its memory after the load
        or save, on that stream, is ordered after its last use (``_load_grouped`` and
        ``_save_grouped`` end with the copy stream after the side stream's last use)."""
        g = self.pages.geometry
        most = max(len(u.group) * len(u.batch) for u in units) * g.blocks_per_chunk * g.page_bytes
        count = 1 if self._side is self.stream or len(units) == 1 else 2
        return [
            torch.empty(most, dtype=torch.uint8, device=self.pages.device) for _ in range(count)
        ]

    def _block_ids(self, chunks: Sequence[ChunkSave] | Sequence[ChunkLoad]) -> torch.Tensor:
        """The chunks' block ids on the KV's device, without blocking the host: a plain
        ``torch.tensor(ids, device="cuda")`` is a pageable copy, which waits for the copy
        stream -- and through ``follow_current`` for the forward pass's queued work. (It
        did: a load returned only once its copies were done, so the forward pass never
        overlapped them; tests/gpu/test_worker_cuda.py's planted missing wait showed it.)"""
        return self._to_device(torch.tensor([b for c in chunks for b in c.block_ids]))

    def _to_device(self, ids: torch.Tensor) -> torch.Tensor:
        """Indices to the KV's device, on the copy stream (whatever reads them follows it)."""
        if self.pages.device.type != "cuda":
            return ids.to(self.pages.device)
        with self.stream.activate():
            return ids.pin_memory().to(self.pages.device, non_blocking=True)

    def _unit_ids(
        self, chunks: Sequence[ChunkSave] | Sequence[ChunkLoad], units: Sequence[_Unit]
    ) -> list[torch.Tensor]:
        """Each unit's indices on the device, all sent in one copy: rows of the stacked
        layers in ``[chunks, layers, blocks]`` order (``_StackedLayers``), else the block
        ids of its chunks as ``[chunks, blocks]``. Made on the host (numpy), so a unit
        starts no kernel to make them."""
        bpc = len(chunks[0].block_ids)  # whole chunks: as many blocks each
        blocks = np.fromiter(
            chain.from_iterable(c.block_ids for c in chunks), np.int64, len(chunks) * bpc
        ).reshape(len(chunks), bpc)
        if self._stacked is None:
            parts = [blocks[u.batch.start : u.batch.stop] for u in units]
        else:
            rows = self._stacked.rows
            parts = [
                rows[u.group[0] : u.group[-1] + 1][None, :, None]
                + blocks[u.batch.start : u.batch.stop, None, :]
                for u in units
            ]
        ids = self._to_device(torch.from_numpy(np.concatenate([p.reshape(-1) for p in parts])))
        views, at = [], 0
        for part in parts:
            views.append(ids[at : at + part.size].view(part.shape[0], -1))
            at += part.size
        return views

    def _gather_ids(self, chunks: Sequence[ChunkSave] | Sequence[ChunkLoad]) -> torch.Tensor | None:
        """For copies layer by layer: the block ids to gather or scatter through (made once
        for every layer), or None when each chunk's runs are copied as they are."""
        if self.gather == "runs" or all(_is_run(c.block_ids) for c in chunks):
            return None
        return self._block_ids(chunks)

    def _staged(self, buffer: torch.Tensor, unit: _Unit) -> torch.Tensor:
        """``[chunks, layers, blocks, page]`` of a unit's pages at the start of ``buffer``."""
        g = self.pages.geometry
        shape = (len(unit.batch), len(unit.group), g.blocks_per_chunk, g.page_bytes)
        return buffer[: shape[0] * shape[1] * shape[2] * shape[3]].view(shape)

    def _load_grouped(
        self, layers: Sequence[int], chunks: Sequence[ChunkLoad], srcs: Sequence[torch.Tensor]
    ) -> list[CopyEvent]:
        """Per unit, one host-to-device copy per chunk for the group's layers into scratch
        (copy stream), then one scatter per layer (side stream), which also marks each
        layer's event once its group is in place. The side stream follows the forward
        pass's queued work: the blocks it overwrites are not read meanwhile."""
        side = self._side
        side.follow_current()
        units = self._units(len(srcs), layers)
        ids = self._unit_ids(chunks, units)
        with self.stream.activate():
            scratch = self._scratch(units)
        drained: list[CopyEvent | None] = [None] * len(scratch)  # side: scatters read it
        events: list[CopyEvent] = []
        for n, unit in enumerate(units):
            turn = n % len(scratch)
            staged = self._staged(scratch[turn], unit)
            first, last = unit.group[0], unit.group[-1] + 1
            before = drained[turn]
            with self.stream.activate():
                if before is not None:
                    self.stream.wait_for(before)
                for i, c in enumerate(unit.batch):
                    staged[i].copy_(srcs[c][first:last], non_blocking=True)
                arrived = self.stream.record()
            side.wait_for(arrived)
            with side.activate():
                words = _words(staged)
                if self._stacked is not None:  # one scatter for the whole group
                    self._stacked.scatter(ids[n], words)
                else:
                    for j, layer in enumerate(unit.group):
                        # [chunks, blocks] ids take the strided [chunks, blocks, page]
                        # scratch as it is (index_copy_ wants it flat: one more copy)
                        _words(self.pages.layers[layer])[ids[n]] = words[:, j]
                done = drained[turn] = side.record()
            if unit.last:
                events += [done] * len(unit.group)
        # The scratch's memory goes back to the copy stream: its next use waits for the
        # scatters that read it.
        self.stream.wait_for(side.record())
        return events

    def _save_grouped(self, layers: Sequence[int], chunks: Sequence[ChunkSave]) -> list[CopyEvent]:
        """Per unit, one gather per layer into scratch (side stream), then one
        device-to-host copy per chunk for the group's layers (copy stream), which marks
        each layer's event once its group is out."""
        side = self._side
        side.follow_current()  # the gathers read what the forward pass wrote
        units = self._units(len(chunks), layers)
        ids = self._unit_ids(chunks, units)
        side.wait_for(self.stream.record())  # the ids; the scratch's memory after its last use
        with self.stream.activate():
            scratch = self._scratch(units)
        drained: list[CopyEvent | None] = [None] * len(scratch)  # copy stream: copies read it
        events: list[CopyEvent] = []
        for n, unit in enumerate(units):
            turn = n % len(scratch)
            staged = self._staged(scratch[turn], unit)
            first, last = unit.group[0], unit.group[-1] + 1
            before = drained[turn]
            with side.activate():
                if before is not None:
                    side.wait_for(before)
                words = _words(staged)
                if self._stacked is not None:  # one gather for the whole group
                    self._stacked.gather(ids[n], words)
                else:
                    for j, layer in enumerate(unit.group):
                        kv = _words(self.pages.layers[layer])
                        pages = kv.index_select(0, ids[n].view(-1))
                        words[:, j] = pages.view(words[:, j].shape)
                gathered = side.record()
            with self.stream.activate():
                self.stream.wait_for(gathered)
                for i, c in enumerate(unit.batch):
                    chunks[c].dst[first:last].copy_(staged[i], non_blocking=True)
                done = drained[turn] = self.stream.record()
            if unit.last:
                events += [done] * len(unit.group)
        return events


class _StackedLayers:
    """All layers' pages as one ``[rows, words]`` view, where the layers are views of one
    buffer at distances of whole pages (vLLM's CUDA layout ``LBNHC`` keeps every layer in
    one backing buffer): page ``b`` of layer ``i`` is row ``rows[i] + b``. A group of
    layers is then gathered or scattered by one kernel instead of one per layer (the
    host's time to start a 128-token load of 32 layers on an H100: 1.6 -> 1.0 ms)."""

    def __init__(self, words: torch.Tensor, rows: np.ndarray) -> None:
        self.words = words
        self.rows = rows  # [layers]

    @classmethod
    def of(cls, pages: KVPages) -> _StackedLayers | None:
        """None unless every layer shares one storage, with one row stride, at offsets a
        whole number of rows apart, in 8-byte words."""
        layers = pages.layers
        first = layers[0]
        stride = first.stride(0)
        storage = first.untyped_storage().data_ptr()
        if any(
            kv.untyped_storage().data_ptr() != storage
            or kv.stride() != first.stride()
            or (kv.storage_offset() - first.storage_offset()) % stride
            for kv in layers
        ):
            return None
        rows = np.array([(kv.storage_offset() - first.storage_offset()) // stride for kv in layers])
        if rows.min() < 0:
            return None
        flat = torch.empty(0, dtype=torch.uint8, device=first.device)
        shape = (int(rows.max()) + first.shape[0], first.shape[1])
        flat.set_(first.untyped_storage(), first.storage_offset(), shape, (stride, 1))
        words = _words(flat)
        return None if words is flat else cls(words, rows)

    def scatter(self, rows: torch.Tensor, staged: torch.Tensor) -> None:
        """``staged``: ``[chunks, layers, blocks, words]``, contiguous, to ``rows`` (in
        that order)."""
        self.words.index_copy_(0, rows.view(-1), staged.view(-1, staged.shape[-1]))

    def gather(self, rows: torch.Tensor, staged: torch.Tensor) -> None:
        torch.index_select(self.words, 0, rows.view(-1), out=staged.view(-1, staged.shape[-1]))


@dataclass(frozen=True, slots=True)
class _Unit:
    """One step of a grouped copy: a group of consecutive layers for a batch of chunks."""

    group: list[int]
    batch: range
    last: bool  # the group's last batch: its layers are in place after it


@dataclass(frozen=True, slots=True)
class _HostCopy:
    """Per layer, one numpy copy between ``chunks`` (``[n, layers, k, page]``: pages of
    ``n`` chunks, ``k`` blocks of each) and ``n * k`` consecutive blocks, from ``block``
    upwards (``step`` 1) or downwards (-1: vLLM hands freed blocks out in reverse order)."""

    chunks: np.ndarray
    block: int
    step: int

    @property
    def layer_bytes(self) -> int:
        """The bytes this copy moves per layer."""
        n, _, k, page = self.chunks.shape
        return n * k * page

    def into(self, kv: np.ndarray, layer: int) -> None:
        """Load: the chunks' pages of ``layer`` into the blocks."""
        self._blocks(kv)[...] = self.chunks[:, layer]

    def out_of(self, kv: np.ndarray, layer: int) -> None:
        """Save: the blocks' pages into the chunks' pages of ``layer``."""
        self.chunks[:, layer] = self._blocks(kv)

    def _blocks(self, kv: np.ndarray) -> np.ndarray:
        """``[n, k, page]`` over the blocks of one layer's ``kv`` (a view)."""
        n, _, k, page = self.chunks.shape
        if self.step > 0:
            return kv[self.block : self.block + n * k].reshape(n, k, page)
        low = self.block - n * k + 1
        return kv[low : self.block + 1].reshape(n, k, page)[::-1, ::-1]


@dataclass(slots=True)
class _Adjacent:
    """Whole chunks that lie one after another in memory (consecutive slots of the arena),
    bound for consecutive blocks in one direction. ``where``: the first chunk's place,
    its address or its offset in the segment (``_host_copies``)."""

    geometry: ChunkGeometry
    first: torch.Tensor | memoryview  # the first chunk's bytes
    where: int
    block: int  # the first chunk's first block
    step: int
    last: torch.Tensor | memoryview | None = None  # the last chunk's, after the first
    count: int = 1

    def extend(self, chunk: torch.Tensor | memoryview, where: int, block: int, step: int) -> bool:
        """Take the next chunk if it continues the run; True if it did.

        A chunk of one block (the CPU's default: 128-token blocks and chunks) has no
        direction of its own: the run's second chunk sets it, so blocks handed out in
        reverse are one copy too (they were one copy per chunk)."""
        g = self.geometry
        if where != self.where + self.count * g.chunk_bytes:
            return False
        if g.blocks_per_chunk == 1:
            if self.count == 1 and abs(block - self.block) == 1:
                self.step = block - self.block
            step = self.step
        if step != self.step or block != self.block + step * self.count * g.blocks_per_chunk:
            return False
        self.count += 1
        self.last = chunk
        return True

    def copy(self, writeable: bool) -> _HostCopy:
        """One copy for all the chunks: a strided ``[count, layers, blocks, page]`` view
        from the first chunk's bytes on. Raises ``ValueError`` if the last chunk is not
        where the run's places say (offsets that are not the buffers' own): the view
        would cover other memory."""
        g = self.geometry
        first = _host_bytes(self.first)
        span = (self.count - 1) * g.chunk_bytes
        if self.last is not None and _address(self.last) - _address(first) != span:
            raise ValueError("chunks' offsets do not match where their bytes are")
        shape = (self.count, g.num_layers, g.blocks_per_chunk, g.page_bytes)
        strides = (g.chunk_bytes, g.blocks_per_chunk * g.page_bytes, g.page_bytes, 1)
        view = as_strided(first, shape, strides, writeable=writeable)
        return _HostCopy(view, self.block, self.step)


ChunkPlace = tuple[torch.Tensor | memoryview, int, Sequence[int], int | None]
"""A chunk's bytes, the first of its blocks copied, the engine's blocks they go with, and
where the bytes start in the segment every chunk of the copy views (None: unknown)."""


def _host_copies(
    places: Sequence[ChunkPlace], geometry: ChunkGeometry, *, writeable: bool
) -> list[_HostCopy]:
    """The host copies of a load or save, as few as the chunks' places allow: whole chunks
    adjacent in memory and paired with consecutive blocks are copied together
    (``_Adjacent``), a chunk paired with consecutive blocks in one copy, any other chunk
    run by run. ``writeable``: the chunks are written (a save).

    Whole chunks are placed by their offsets in the segment where every chunk has one
    (``ChunkLoad.offset``), else by their addresses. Asking numpy for each chunk's address
    took most of the plan of a 47-chunk load (0.21-0.25 ms of Python in all, on the copy
    thread, holding the interpreter lock the engine's forward pass needs): now a run's
    first and last chunks alone are asked, the last to check the offsets."""
    g, chunk_bytes = geometry, geometry.chunk_bytes
    by_offset = all(place[3] is not None for place in places)
    copies: list[_HostCopy] = []
    adjacent: _Adjacent | None = None
    for buffer, first, block_ids, offset in places:
        if buffer.nbytes != chunk_bytes:
            raise ValueError(f"chunk of {buffer.nbytes} bytes, expected {chunk_bytes}")
        ids = block_ids if type(block_ids) is tuple else tuple(block_ids)
        step = _direction(ids)
        if step is not None and first == 0 and len(ids) == g.blocks_per_chunk:
            where = offset if offset is not None and by_offset else _address(buffer)
            if adjacent is not None and adjacent.extend(buffer, where, ids[0], step):
                continue
            if adjacent is not None:
                copies.append(adjacent.copy(writeable))
            adjacent = _Adjacent(g, buffer, where, ids[0], step)
            continue
        if adjacent is not None:
            copies.append(adjacent.copy(writeable))
            adjacent = None
        pages = _host_bytes(buffer).reshape(1, g.num_layers, g.blocks_per_chunk, g.page_bytes)
        if step is not None:
            copies.append(_HostCopy(pages[:, :, first : first + len(ids)], ids[0], step))
            continue
        for start, block, n in runs_of(ids):
            copies.append(_HostCopy(pages[:, :, first + start : first + start + n], block, 1))
    if adjacent is not None:
        copies.append(adjacent.copy(writeable))
    return copies


def _direction(ids: tuple[int, ...]) -> int | None:
    """1 if the block ids count up one by one (or there is one), -1 if down, else None."""
    if len(ids) <= 1:
        return 1 if ids else None
    if ids == tuple(range(ids[0], ids[0] + len(ids))):
        return 1
    if ids == tuple(range(ids[0], ids[0] - len(ids), -1)):
        return -1
    return None


def _host_bytes(src: torch.Tensor | memoryview) -> np.ndarray:
    """A chunk's bytes as a flat uint8 array over the same memory (no copy)."""
    if isinstance(src, torch.Tensor):
        return src.numpy().reshape(-1)
    return np.frombuffer(src, dtype=np.uint8)


def _address(src: torch.Tensor | memoryview | np.ndarray) -> int:
    """Where a chunk's bytes start in this process's memory."""
    if isinstance(src, torch.Tensor):
        return src.data_ptr()
    array = src if isinstance(src, np.ndarray) else np.frombuffer(src, dtype=np.uint8)
    return int(array.__array_interface__["data"][0])


def _runs_in_words(
    chunks: Sequence[torch.Tensor], device: torch.device, rows: torch.Tensor
) -> list[tuple[int, torch.Tensor]] | None:
    """(index of the first, ``[n, *chunk shape]`` in words over their memory) for each run
    of chunks of one shape that lie one after another in one storage; None unless every
    chunk is contiguous, on ``device``, in words (``_words``) of the type and width of
    ``rows`` (the KV's pages as rows of words: ``_StackedLayers``). A chunk after
    a run's first is told by its address alone (inside the first's storage, where the run
    ends): the checks of every chunk as a tensor cost the host 6-9 us a chunk, 0.2-0.3 ms
    of a 1 GiB hit of 32 chunks (tests/gpu/check.py's geometry), more than the addresses'
    1-2 us."""
    runs: list[tuple[int, torch.Tensor]] = []
    head: torch.Tensor | None = None  # the current run's first chunk
    head_words = rows  # the same in words (rows: a placeholder until the first chunk)
    first = end = limit = 0  # its index; where the run ends, and the first's storage
    for i, chunk in enumerate(chunks):
        at = chunk.data_ptr()
        if (
            head is not None
            and at == end
            and end + chunk.nbytes <= limit
            and chunk.shape == head.shape
            and chunk.dtype == head.dtype
            and chunk.is_contiguous()
        ):
            end += chunk.nbytes
            continue
        if head is not None:
            runs.append((first, _stacked_run(head_words, i - first)))
        words = _words(chunk)
        if (
            chunk.device != device
            or not chunk.is_contiguous()
            or words.dtype != rows.dtype
            or words.shape[-1] != rows.shape[-1]
        ):
            return None
        storage = chunk.untyped_storage()
        head, head_words, first, end = chunk, words, i, at + chunk.nbytes
        limit = storage.data_ptr() + storage.nbytes()
    if head is not None:
        runs.append((first, _stacked_run(head_words, len(chunks) - first)))
    return runs


def _stacked_run(words: torch.Tensor, n: int) -> torch.Tensor:
    """``[n, *words' shape]`` over ``n`` chunks that lie one after another from the chunk
    ``words`` views, in its storage."""
    return words.as_strided((n, *words.shape), (words.numel(), *words.stride()))


def _words(pages: torch.Tensor) -> torch.Tensor:
    """The same bytes as 8-byte words where they allow it, for the device's gathers and
    scatters: their kernels move one element per thread, so over uint8 pages they ran at a
    tenth of a device copy's speed (on an H100, docs/gpu.md)."""
    if (
        pages.dtype == torch.uint8
        and pages.shape[-1] % 8 == 0
        and pages.stride(-1) == 1
        and pages.storage_offset() % 8 == 0
        and all(s % 8 == 0 for s in pages.stride()[:-1])
    ):
        return pages.view(torch.int64)
    return pages


def _numpy_views(layers: Sequence[torch.Tensor]) -> list[np.ndarray] | None:
    """numpy arrays over the layers' memory; None (copy with torch) where torch refuses."""
    try:
        return [kv.numpy() for kv in layers]
    except (RuntimeError, TypeError):
        return None


def _is_run(block_ids: Sequence[int]) -> bool:
    return len(runs_of(block_ids)) <= 1

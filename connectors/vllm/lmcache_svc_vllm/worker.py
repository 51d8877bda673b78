"""Worker half: copies KV pages between vLLM's blocks and the server's shared segment.

Loads: lease the chunks (``prepare_load``), copy the leased bytes straight into the
request's blocks, release (in the background). On the CPU, when the server's lookup index
locates every chunk of a load in the mapped segment, they are copied with no lease and no
round trip (``read_in_place``), then checked: if one changed during the copy, the load is
done again under a lease; the server is told what was read at the next step (``touch``). Sync
loads run in ``start_load_kv`` before the forward pass; async loads run on a loader thread
and are reported through ``take_finished``. Chunks the server no longer has (evicted,
restarted, unreachable) become failed blocks that vLLM recomputes (``take_load_errors``).

Saves: the scheduler plans a chunk's save for the step after the one that computed it
(``scheduler.py``). The slot reservation (``prepare_store``) is requested when the step's
plan arrives (after the step's loads have copied, when it has some: the call would compete
with the copies for the interpreter), so it overlaps the forward pass; after the forward,
the chunks' pages are copied into the reserved slots and the commit is handed to a
background thread. The step waits only for the copy (and for a reservation that is slower
than the forward pass). Finished requests whose blocks vLLM held for a save are reported
once the copy is done (``take_saved``).

Copies go through a ``PageMover`` (``mover.py``): per layer, one gather or scatter per
request. On CUDA they run on a dedicated stream with one event per layer: the forward pass
waits (on the device) only for the layer it is about to run (``wait_for_layer_load``), a
layer's save is enqueued as soon as that layer ran (``save_layer``) once the reservation is
there, and the mapped segment is page-locked in the background (``pinning.py``). On the CPU
a step's load that is big enough goes to a copy thread (``copy_thread.py``,
``overlap_loads``): the forward pass waits for each layer before its attention, and after it
the reads in place are checked (a chunk that changed meanwhile is recomputed:
``_check_late``). Smaller loads and saves copy in the caller.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from lmcache_svc.client.in_place import InPlaceRead
from lmcache_svc.keys import Namespace
from lmcache_svc_vllm import trace
from lmcache_svc_vllm.copy_thread import CopyThread
from lmcache_svc_vllm.cores import off_compute_cores
from lmcache_svc_vllm.layout import KVPages, UnsupportedLayout, layer_sort_key
from lmcache_svc_vllm.link import Acquired, Reservation, ServerLink
from lmcache_svc_vllm.metadata import LoadPlan, SavePlan, StepPlan
from lmcache_svc_vllm.mover import ChunkLoad, ChunkSave, LayerEvents, PageMover
from lmcache_svc_vllm.pinning import HostPinner, cuda_drain, cuda_host_registrar
from lmcache_svc_vllm.prefetch import Prefetches
from lmcache_svc_vllm.save_tokens import describe_saves
from lmcache_svc_vllm.stats import StatsRecorder
from lmcache_svc_vllm.streams import copy_stream_for

logger = logging.getLogger(f"vllm.{__name__}")
TOUCH_DELAY_S = 1.0
"""At most this long between a read in place and telling the server (``_touch_later``)."""


class WorkerSide:
    def __init__(
        self,
        namespace: Namespace,
        link: ServerLink,
        stats: StatsRecorder,
        *,
        num_blocks: int,
        page_order: str,
        layerwise: bool | None = None,
        prefetches: Prefetches | None = None,
    ) -> None:
        """``layerwise``: per-layer load waits and saves (default: on CUDA only).
        ``prefetches``: the process's leases started by the scheduler half, for a worker in
        the scheduler's process (``prefetch.py``); None: this worker leases itself."""
        self.namespace = namespace
        self.tp_rank = namespace.tp_rank
        self.link = link
        self.stats = stats
        self.blocks_per_chunk = namespace.chunk_size // namespace.layout.block_size
        self._num_blocks = num_blocks
        self._page_order = page_order
        self._pages: KVPages | None = None
        self._mover: PageMover | None = None
        self._layer_ids: dict[str, int] = {}
        self._layerwise_choice = layerwise
        self._layerwise = False
        self._in_place = False
        self._pinner: HostPinner | None = None
        self._step_loads: list[LayerEvents] = []
        self._step_checks: list[Callable[[], None]] = []  # after the step's loads copied
        self._copier: CopyThread | None = None
        self._step_plan: StepPlan | None = None
        self._step_saves: list[ChunkSave] | None = None
        self._saved_layers: set[int] = set()
        # Off the cores vLLM bound the forward pass to (CPU backend; cores.py).
        self._io = ThreadPoolExecutor(
            1, thread_name_prefix="lmcache-svc-io", initializer=off_compute_cores
        )
        self._loader = ThreadPoolExecutor(
            1, thread_name_prefix="lmcache-svc-load", initializer=off_compute_cores
        )
        self._reservation: Future[Reservation | None] | None = None
        self._reserve_after_loads = False
        self._lock = threading.Lock()
        self._finished_loads: set[str] = set()
        self._saved: set[str] = set()
        self._touches: list[bytes] = []  # read in place, not told to the server yet
        self._touch_since: float | None = None  # when the oldest of them was read
        self._touch_stop = threading.Event()  # set at shutdown
        self._load_errors: set[int] = set()
        self._prefetches = prefetches

    # -- set-up --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        try:
            pages = KVPages.from_kv_caches(
                kv_caches,
                num_blocks=self._num_blocks,
                blocks_per_chunk=self.blocks_per_chunk,
                page_order=self._page_order,
            )
        except UnsupportedLayout as e:
            logger.error("lmcache-svc: KV cache not supported, plugin disabled: %s", e)
            return
        if pages.geometry.chunk_bytes != self.namespace.chunk_bytes:
            logger.error(
                "lmcache-svc: KV tensors give %d bytes per chunk but the namespace expects %d; "
                "plugin disabled",
                pages.geometry.chunk_bytes,
                self.namespace.chunk_bytes,
            )
            return
        self._pages = pages
        config = self.link.config
        if pages.device.type == "cpu" and config.overlap_loads:
            self._copier = CopyThread()
        self._mover = PageMover(
            pages,
            copy_stream_for(pages.device),
            copier=self._copier,
            copier_min_bytes=config.tuning.overlap_load_min_bytes,
        )
        self._layer_ids = {n: i for i, n in enumerate(sorted(kv_caches, key=layer_sort_key))}
        is_cuda = pages.device.type == "cuda"
        self._layerwise = is_cuda if self._layerwise_choice is None else self._layerwise_choice
        self._in_place = self.link.config.read_in_place and pages.device.type == "cpu"
        if self._in_place:
            threading.Thread(
                target=self._touch_when_idle, name="lmcache-svc-touch", daemon=True
            ).start()
        if is_cuda:
            self._pinner = HostPinner(*cuda_host_registrar(), drain=cuda_drain(pages.device))
        self._in_background(self.link.warm_up)
        if self._prefetches is not None and not self._in_place:  # reads in place need none
            self._prefetches.attach(self.namespace.namespace_id, self.link)
        logger.info(
            "lmcache-svc: %d layers, %d-byte pages, %d-byte chunks (%s)",
            pages.geometry.num_layers,
            pages.geometry.page_bytes,
            pages.geometry.chunk_bytes,
            self.namespace.layout.page_layout,
        )

    # -- per step ------------------------------------------------------------------------

    def bind(self, plan: StepPlan) -> None:
        """A new step's plan: ask for the save slots now, to overlap the forward pass (after
        the step's loads when it has some: the call would slow their copies)."""
        self._flush_touches()  # the previous step's reads: its first tokens are out now
        self._finish_loads()  # a step vLLM did not finish (none expected)
        self._step_plan, self._step_saves = plan, None
        self._saved_layers, self._step_loads = set(), []
        self._reservation = None
        self._reserve_after_loads = any(not load.is_async for load in plan.loads)
        if not self._reserve_after_loads:
            self._reserve(plan)

    def _reserve(self, plan: StepPlan) -> None:
        self._reserve_after_loads = False
        hashes = _unique(h for s in plan.saves for h in s.hashes_for(self.tp_rank))
        if self._pages is None or not hashes:
            return
        chunk_bytes = self.namespace.chunk_bytes
        self._reservation = self._io.submit(
            self.stats.cpu_timed, self.link.reserve, hashes, chunk_bytes
        )

    def start_load(self, plan: StepPlan) -> None:
        for load in plan.loads:
            if load.is_async:
                self._loader.submit(self.stats.cpu_timed, self._run_async_load, load)
            else:
                self._record_failures(self._load(load, step=True))
        if self._reserve_after_loads:
            self._reserve(plan)  # held back by bind while the loads copied

    def per_layer(self) -> bool:
        """Whether the forward pass still has work at its layers: layer-wise (CUDA), a load
        on the copy stream or saves to enqueue layer by layer; else a load copying beside
        it that is not done yet (one done by then needs no wait: its check comes after the
        forward pass, ``_finish_loads``)."""
        if self._layerwise:
            return bool(self._step_loads) or self._reservation is not None
        return any(not events.done() for events in self._step_loads)

    def wait_for_layer(self, layer_name: str) -> None:
        """Before the layer runs: its loaded pages must be in place (device-side wait; a
        layer not registered waits for every layer)."""
        i = self._layer_ids.get(layer_name)
        for events in self._step_loads:
            if i is None:
                for layer in range(len(events.events)):
                    events.wait_on_device(layer)
            else:
                events.wait_on_device(i)

    def _finish_loads(self) -> None:
        """After the forward pass: the checks of the step's loads that copied beside it
        (their failures reach vLLM with this step's output)."""
        checks, self._step_checks = self._step_checks, []
        for check in checks:
            check()

    def save_layer(self, layer_name: str) -> None:
        """After the layer ran (CUDA): enqueue its saves now if the slots are reserved."""
        future, i = self._reservation, self._layer_ids.get(layer_name)
        if not self._layerwise or future is None or i is None or not future.done():
            return
        reservation = None if future.exception() is not None else future.result()
        try:
            chunks = self._chunk_saves(reservation)
            if chunks is not None and self._mover is not None:
                self._mover.save(chunks, layers=[i])
                self._saved_layers.add(i)
        except Exception:  # never into vLLM: wait_for_save copies the layer (or gives up)
            logger.exception("lmcache-svc: saving layer %s failed", layer_name)

    def wait_for_save(self, plan: StepPlan) -> None:
        self._finish_loads()
        try:
            self._save(plan)
        finally:  # copied or given up: vLLM may free the finished requests' blocks now
            if plan.held:
                with self._lock:
                    self._saved.update(plan.held)

    def _save(self, plan: StepPlan) -> None:
        if self._reserve_after_loads:  # no start_load this step (not expected)
            self._reserve(plan)
        future, self._reservation = self._reservation, None
        if future is None:
            return
        num_planned = sum(len(s.hashes_for(self.tp_rank)) for s in plan.saves)
        reservation = self._wait_reservation(future)
        trace.mark("save.reserved")
        if reservation is None or self._pages is None:
            self.stats.add(save_skipped_chunks=num_planned)
            return
        start = time.perf_counter()
        ok = self._copy_out(reservation)
        trace.mark("save.copied")
        self.stats.time("save_seconds", time.perf_counter() - start)
        described = describe_saves(plan.saves, self.tp_rank, self.namespace.chunk_size)
        self._in_background(self._publish, reservation, num_planned, ok, described)

    def _publish(
        self, reservation: Reservation, num_planned: int, ok: bool, described: Any = None
    ) -> None:
        """On the I/O thread: commit the copied chunks (or give the slots back)."""
        committed = self.link.publish(reservation, abort=not ok, described=described)
        stored = committed if ok else 0
        self.stats.add(
            save_skipped_chunks=num_planned - stored,
            save_chunks=stored,
            save_bytes=stored * self.namespace.chunk_bytes,
        )

    def _wait_reservation(self, future: Future[Reservation | None]) -> Reservation | None:
        timeout_s = self.link.config.rpc_timeout_ms / 1000
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            logger.warning("lmcache-svc: store reservation took over %.1f s; skipped", timeout_s)
            future.add_done_callback(self._abort_late)
            return None
        except Exception:  # never into vLLM: the step's saves are skipped
            logger.exception("lmcache-svc: reserving store slots failed; saves skipped")
            return None

    def _abort_late(self, future: Future[Reservation | None]) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        reservation = future.result()
        if reservation is not None:
            self._in_background(self.link.publish, reservation, abort=True)

    def take_finished(self) -> set[str]:
        with self._lock:
            done, self._finished_loads = self._finished_loads, set()
        return done

    def take_saved(self) -> set[str]:
        """Finished requests whose held blocks the worker no longer needs."""
        with self._lock:
            saved, self._saved = self._saved, set()
        return saved

    def take_load_errors(self) -> set[int]:
        self._finish_loads()
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._touch_stop.set()
        self._flush_touches()
        if self._prefetches is not None:
            self._prefetches.detach(self.namespace.namespace_id)
        self._loader.shutdown(wait=True, cancel_futures=True)
        if self._copier is not None:
            self._copier.shutdown()
        self._io.shutdown(wait=True, cancel_futures=True)
        if self._pinner is not None:
            self._pinner.close()  # unregister before the segment is unmapped
        self.link.close()

    # -- loads ---------------------------------------------------------------------------

    def _run_async_load(self, plan: LoadPlan) -> None:
        """On the loader thread. Whatever happens, the request is reported finished (vLLM
        waits for it), with the blocks that were not loaded as errors (they are recomputed)."""
        failed: Sequence[int] = plan.block_ids
        try:
            failed = self._load(plan, step=False)
        except Exception:
            logger.exception("lmcache-svc: loading request %s failed; recomputing", plan.req_id)
        finally:
            with self._lock:
                self._load_errors.update(failed)
                self._finished_loads.add(plan.req_id)

    def _in_background(self, fn: Callable[..., object], /, *args: Any, **kwargs: Any) -> None:
        """Run ``fn`` on the I/O thread, nobody waiting for it: an exception is logged there
        (a submitted call's exception would otherwise be kept in a future no one reads)."""

        def run() -> None:
            try:
                self.stats.cpu_timed(fn, *args, **kwargs)
            except Exception:
                logger.exception("lmcache-svc: %s failed on the I/O thread", _name(fn))

        self._io.submit(run)

    def _record_failures(self, failed: Sequence[int]) -> None:
        if failed:
            with self._lock:
                self._load_errors.update(failed)

    def _load(self, plan: LoadPlan, *, step: bool) -> list[int]:
        """Copy the plan's chunks in; returns the block ids that could not be loaded.

        ``step``: a load of the coming forward pass, which waits per layer on CUDA (or for
        all of it here when layer-wise waits are off) and on the CPU for the layers the copy
        thread copies beside it (``overlap_loads``); otherwise the copy is awaited here."""
        pages, mover = self._pages, self._mover
        if pages is None or mover is None:
            return list(plan.block_ids)
        start = time.perf_counter()
        hashes = plan.hashes_for(self.tp_rank)
        acquired = self._prefetched(plan.req_id, hashes)
        loaded = self._load_in_place(plan, hashes, step) if acquired is None else None
        if loaded is None:
            acquired = acquired or self.link.acquire(hashes)
            trace.mark("load.acquired")
            if acquired is None:
                return self._failed(plan, list(plan.block_ids))
            loaded = self._load_leased(plan, acquired, step)
        num_chunks, num_loaded_blocks = loaded
        self.stats.time("load_seconds", time.perf_counter() - start)
        self.stats.add(
            load_chunks=num_chunks,
            load_bytes=num_loaded_blocks * pages.geometry.num_layers * pages.geometry.page_bytes,
        )
        return self._failed(plan, list(plan.block_ids[num_loaded_blocks:]))

    def _load_in_place(
        self, plan: LoadPlan, hashes: Sequence[bytes], step: bool
    ) -> tuple[int, int] | None:
        """Copy every chunk straight from the segment, without a lease (CPU copies only:
        the check needs the copy done); (chunks, blocks) loaded, or None: lease instead
        (not all of them located, or one changed while it was copied)."""
        if not self._in_place:
            return None
        placement = plan.placement if self.tp_rank == 0 else None  # rank 0's chunks
        read = self.link.read_in_place(hashes, placement)
        trace.mark("load.located")
        if read is None:
            return None
        try:
            events, num_blocks = self._copy_in_place(plan, read, step)
            if step and self._beside_forward(events):
                self._step_loads.append(events)
                self._step_checks.append(lambda: self._check_late(plan, hashes, read, events))
                return read.num_chunks, num_blocks
            events.synchronize()
        except Exception:  # never into vLLM: a lease is taken instead
            logger.exception("lmcache-svc: copying chunks read in place failed")
            return None
        if read.unchanged() < read.num_chunks:
            trace.mark("load.changed")
            self.stats.add(load_in_place_retries=1)
            return None  # its blocks are all written again (or recomputed)
        trace.mark("load.copied")
        self._read_in_place(hashes, read.num_chunks)
        return read.num_chunks, num_blocks

    def _check_late(
        self, plan: LoadPlan, hashes: Sequence[bytes], read: InPlaceRead, events: LayerEvents
    ) -> None:
        """A read in place whose layers copied beside the forward pass, checked after
        it: the forward pass has used the bytes, so a chunk that changed meanwhile (or a
        failed copy) cannot be copied again under a lease; vLLM recomputes its blocks."""
        try:
            events.synchronize()
            num_good = read.unchanged()
        except Exception:
            logger.exception("lmcache-svc: copying chunks read in place failed")
            num_good = 0
        if num_good < read.num_chunks:
            trace.mark("load.changed")
            self.stats.add(load_in_place_late_changes=1)
            bad = self._chunk_blocks(plan)[num_good:]
            self._record_failures(self._failed(plan, [b for _, ids in bad for b in ids]))
        if num_good:
            self._read_in_place(hashes[:num_good], num_good)

    def _read_in_place(self, hashes: Sequence[bytes], num_chunks: int) -> None:
        """Chunks read in place and checked: the server hears of them later."""
        self._touch_later(hashes)
        self.stats.add(load_in_place_chunks=num_chunks)

    def _touch_later(self, hashes: Sequence[bytes]) -> None:
        """Tell the server about chunks read in place at the next step (or, on an idle
        engine, within ``TOUCH_DELAY_S``), not during this one: the call would compete with
        this step's forward pass and its first token. Nothing is woken here either (the
        touch thread looks by itself): a wake-up cost the first token a system call and a
        turn of the GIL."""
        with self._lock:
            self._touches.extend(hashes)
            if self._touch_since is None:
                self._touch_since = time.monotonic()

    def _touch_when_idle(self) -> None:
        """Every half ``TOUCH_DELAY_S``, flushes the touches that no step flushed and that
        are at least that old (so each is told within ``TOUCH_DELAY_S``)."""
        while not self._touch_stop.wait(TOUCH_DELAY_S / 2):
            with self._lock:
                since = self._touch_since
            if since is not None and time.monotonic() - since >= TOUCH_DELAY_S / 2:
                self._flush_touches()

    def _flush_touches(self) -> None:
        with self._lock:
            hashes, self._touches = self._touches, []
            self._touch_since = None
        if hashes:
            self._in_background(self.link.touch, _unique(hashes))

    def _load_leased(self, plan: LoadPlan, acquired: Acquired, step: bool) -> tuple[int, int]:
        """Copy a lease's chunks in and release it once they are copied (in the background);
        (chunks, blocks) loaded."""
        num_loaded_blocks = 0
        events: LayerEvents | None = None
        try:
            self._pin(acquired.buffers)
            events, num_loaded_blocks = self._copy_in(
                plan, acquired.buffers, acquired.offsets, step
            )
            copying, copied = events, num_loaded_blocks
            if step and self._beside_forward(copying):
                self._step_loads.append(copying)
                self._step_checks.append(lambda: self._check_copied(plan, copying, copied))
            elif step and self._layerwise:
                self._step_loads.append(copying)
            else:
                copying.synchronize()
        except Exception:  # never into vLLM: the blocks are recomputed instead
            logger.exception("lmcache-svc: copying loaded chunks failed")
            num_loaded_blocks = 0
        finally:  # once the bytes are copied, off the step
            if events is None or not self._beside_forward(events):
                trace.mark("load.copied")  # else the copy thread marks it
            self._in_background(self._release_after, events, acquired)
        return min(len(acquired.buffers), len(plan.hashes_for(self.tp_rank))), num_loaded_blocks

    def _copy_in(
        self, plan: LoadPlan, buffers: Sequence[memoryview], offsets: Sequence[int], step: bool
    ) -> tuple[LayerEvents, int]:
        """Start copying chunk ``buffers`` into the plan's blocks (on the copy
        thread when ``step`` is set and the load is big enough); (events, blocks).
        ``offsets``: where the buffers start in the server's segment (empty: unknown)."""
        assert self._pages is not None and self._mover is not None
        places = self._chunk_blocks(plan)
        where: Sequence[int | None] = (
            offsets if len(offsets) == len(buffers) else [None] * len(buffers)
        )
        chunks = [
            ChunkLoad(buffer, first, block_ids, offset)
            for (first, block_ids), buffer, offset in zip(places, buffers, where)
        ]
        return self._mover.load(chunks, beside=step), sum(len(c.block_ids) for c in chunks)

    def _copy_in_place(
        self, plan: LoadPlan, read: InPlaceRead, step: bool
    ) -> tuple[LayerEvents, int]:
        """``_copy_in`` of chunks read in place: through one view of them all where they lie
        one after another and so do their blocks (``PageMover.load_span``)."""
        assert self._mover is not None
        span = read.span() if plan.first_block == 0 else None
        events = None if span is None else self._mover.load_span(span, plan.block_ids, beside=step)
        if events is not None:
            return events, len(plan.block_ids)
        return self._copy_in(plan, read.buffers, read.offsets, step)

    def _prefetched(self, req_id: str, hashes: Sequence[bytes]) -> Acquired | None:
        if self._prefetches is None:
            return None
        acquired = self._prefetches.take(req_id, hashes, self.link.config.rpc_timeout_ms / 1000)
        if acquired is not None:
            trace.mark("load.prefetched")
        return acquired

    def _beside_forward(self, events: LayerEvents) -> bool:
        """A load still copying on the copy thread (``overlap_loads``)."""
        return self._copier is not None and not events.done()

    def _check_copied(self, plan: LoadPlan, events: LayerEvents, num_blocks: int) -> None:
        """After the forward pass: a leased load that copied beside it; if a
        copy failed, its blocks are recomputed."""
        try:
            events.synchronize()
        except Exception:
            logger.exception("lmcache-svc: copying loaded chunks failed")
            self._record_failures(self._failed(plan, list(plan.block_ids[:num_blocks])))

    def _release_after(self, events: LayerEvents | None, acquired: Any) -> None:
        try:
            if events is not None:
                events.synchronize()  # a failed copy is over too (its step check reports it)
        finally:
            self.link.release(acquired)

    def _pin(self, buffers: Sequence[memoryview]) -> None:
        if self._pinner is not None and buffers:
            self._pinner.add_buffer(buffers[0])

    def _failed(self, plan: LoadPlan, block_ids: list[int]) -> list[int]:
        if block_ids:
            logger.warning(
                "lmcache-svc: %d of %d blocks of request %s not loaded; vLLM recomputes them",
                len(block_ids),
                len(plan.block_ids),
                plan.req_id,
            )
            self.stats.add(load_failed_blocks=len(block_ids))
        return block_ids

    def _chunk_blocks(self, plan: LoadPlan) -> list[tuple[int, tuple[int, ...]]]:
        """(first block inside the chunk, destination block ids) for each chunk of a load."""
        ids, first, k = plan.block_ids, plan.first_block, self.blocks_per_chunk
        if not ids:
            return []
        head = k - first  # the first chunk's blocks; then whole chunks (the last maybe not)
        return [(first, ids[:head]), *((0, ids[i : i + k]) for i in range(head, len(ids), k))]

    # -- saves ---------------------------------------------------------------------------

    def _copy_out(self, reservation: Reservation) -> bool:
        """Copy the reserved chunks' pages (the layers not saved yet) into their slots and
        wait for the copies; False if a copy failed."""
        assert self._mover is not None
        try:
            chunks = self._chunk_saves(reservation)
            if chunks is None:
                return False
            todo = [i for i in range(len(self._mover.pages.layers)) if i not in self._saved_layers]
            self._mover.save(chunks, layers=todo).synchronize()
        except Exception:  # never into vLLM: the chunks are just not stored
            logger.exception("lmcache-svc: copying chunks out failed")
            return False
        return True

    def _chunk_saves(self, reservation: Reservation | None) -> list[ChunkSave] | None:
        if reservation is None or self._pages is None or self._step_plan is None:
            return None
        if self._step_saves is None:
            self._pin(reservation.buffers)
            sources = self._source_blocks(self._step_plan.saves)
            self._step_saves = [
                ChunkSave(sources[chunk_hash], self._pages.chunk_tensor(buffer))
                for chunk_hash, buffer in zip(reservation.hashes, reservation.buffers)
            ]
        return self._step_saves

    def _source_blocks(self, saves: Sequence[SavePlan]) -> dict[bytes, tuple[int, ...]]:
        bpc = self.blocks_per_chunk
        sources: dict[bytes, tuple[int, ...]] = {}
        for save in saves:
            for i, chunk_hash in enumerate(save.hashes_for(self.tp_rank)):
                sources.setdefault(chunk_hash, save.block_ids[i * bpc : (i + 1) * bpc])
        return sources


def _unique(hashes: Any) -> list[bytes]:
    return list(dict.fromkeys(hashes))


def _name(fn: Callable[..., object]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)

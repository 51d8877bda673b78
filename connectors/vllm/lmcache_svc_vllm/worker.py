"""Worker half: copies KV pages between vLLM's blocks and the server's shared segment.

Loads: lease the chunks (``prepare_load``), copy the leased bytes straight into the
request's blocks, release (in the background). Sync loads run in ``start_load_kv`` before
the forward pass; async loads run on a loader thread and are reported through
``take_finished``. Chunks the
server no longer has (evicted, restarted, unreachable) become failed blocks that vLLM
recomputes (``take_load_errors``).

Saves: the slot reservation (``prepare_store``) is requested when the step's plan arrives,
so it overlaps the forward pass; after the forward, the completed chunks' pages are copied
into the reserved slots and the commit is handed to a background thread. The step waits
only for the copy (and for a reservation that is slower than the forward pass).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from lmcache_svc.keys import Namespace
from lmcache_svc_vllm.layout import KVPages, UnsupportedLayout
from lmcache_svc_vllm.link import Reservation, ServerLink
from lmcache_svc_vllm.metadata import LoadPlan, SavePlan, StepPlan
from lmcache_svc_vllm.stats import StatsRecorder

logger = logging.getLogger(f"vllm.{__name__}")


class WorkerSide:
    def __init__(
        self,
        namespace: Namespace,
        link: ServerLink,
        stats: StatsRecorder,
        *,
        num_blocks: int,
        page_order: str,
    ) -> None:
        self.namespace = namespace
        self.tp_rank = namespace.tp_rank
        self.link = link
        self.stats = stats
        self.blocks_per_chunk = namespace.chunk_size // namespace.layout.block_size
        self._num_blocks = num_blocks
        self._page_order = page_order
        self._pages: KVPages | None = None
        self._io = ThreadPoolExecutor(1, thread_name_prefix="lmcache-svc-io")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="lmcache-svc-load")
        self._reservation: Future[Reservation | None] | None = None
        self._lock = threading.Lock()
        self._finished_loads: set[str] = set()
        self._load_errors: set[int] = set()

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
        self._io.submit(self.link.warm_up)
        logger.info(
            "lmcache-svc: %d layers, %d-byte pages, %d-byte chunks (%s)",
            pages.geometry.num_layers,
            pages.geometry.page_bytes,
            pages.geometry.chunk_bytes,
            self.namespace.layout.page_layout,
        )

    # -- per step ------------------------------------------------------------------------

    def bind(self, plan: StepPlan) -> None:
        """A new step's plan: ask for the save slots now, to overlap the forward pass."""
        hashes = _unique(h for s in plan.saves for h in s.hashes_for(self.tp_rank))
        if self._pages is None or not hashes:
            self._reservation = None
            return
        chunk_bytes = self.namespace.chunk_bytes
        self._reservation = self._io.submit(self.link.reserve, hashes, chunk_bytes)

    def start_load(self, plan: StepPlan) -> None:
        for load in plan.loads:
            if load.is_async:
                self._loader.submit(self._run_async_load, load)
            else:
                self._record_failures(self._load(load))

    def wait_for_save(self, plan: StepPlan) -> None:
        future, self._reservation = self._reservation, None
        if future is None:
            return
        num_planned = sum(len(s.hashes_for(self.tp_rank)) for s in plan.saves)
        reservation = self._wait_reservation(future)
        if reservation is None or self._pages is None:
            self.stats.add(save_skipped_chunks=num_planned)
            return
        start = time.perf_counter()
        ok = self._copy_out(plan.saves, reservation)
        self.stats.time("save_seconds", time.perf_counter() - start)
        self._io.submit(self._publish, reservation, num_planned, ok)

    def _publish(self, reservation: Reservation, num_planned: int, ok: bool) -> None:
        """On the I/O thread: commit the copied chunks (or give the slots back)."""
        committed = self.link.publish(reservation, abort=not ok)
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

    def _abort_late(self, future: Future[Reservation | None]) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        reservation = future.result()
        if reservation is not None:
            self._io.submit(self.link.publish, reservation, abort=True)

    def take_finished(self) -> set[str]:
        with self._lock:
            done, self._finished_loads = self._finished_loads, set()
        return done

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
        self._io.shutdown(wait=True, cancel_futures=True)
        self.link.close()

    # -- loads ---------------------------------------------------------------------------

    def _run_async_load(self, plan: LoadPlan) -> None:
        failed = self._load(plan)
        with self._lock:
            self._load_errors.update(failed)
            self._finished_loads.add(plan.req_id)

    def _record_failures(self, failed: Sequence[int]) -> None:
        if failed:
            with self._lock:
                self._load_errors.update(failed)

    def _load(self, plan: LoadPlan) -> list[int]:
        """Copy the plan's chunks in; returns the block ids that could not be loaded."""
        pages = self._pages
        if pages is None:
            return list(plan.block_ids)
        start = time.perf_counter()
        acquired = self.link.acquire(plan.hashes_for(self.tp_rank))
        if acquired is None:
            return self._failed(plan, list(plan.block_ids))
        num_loaded_blocks = 0
        try:
            for (first, block_ids), buffer in zip(self._chunk_blocks(plan), acquired.buffers):
                pages.copy_chunk_in(pages.chunk_tensor(buffer), first, block_ids)
                num_loaded_blocks += len(block_ids)
        except Exception:  # never into vLLM: the blocks are recomputed instead
            logger.exception("lmcache-svc: copying loaded chunks failed")
        finally:
            self._io.submit(self.link.release, acquired)  # the bytes are copied: off the step
        num_chunks = min(len(acquired.buffers), len(plan.hashes_for(self.tp_rank)))
        self.stats.time("load_seconds", time.perf_counter() - start)
        self.stats.add(
            load_chunks=num_chunks,
            load_bytes=num_loaded_blocks * pages.geometry.num_layers * pages.geometry.page_bytes,
        )
        return self._failed(plan, list(plan.block_ids[num_loaded_blocks:]))

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
        out: list[tuple[int, tuple[int, ...]]] = []
        pos, first = 0, plan.first_block
        while pos < len(plan.block_ids):
            n = min(self.blocks_per_chunk - first, len(plan.block_ids) - pos)
            out.append((first, plan.block_ids[pos : pos + n]))
            pos, first = pos + n, 0
        return out

    # -- saves ---------------------------------------------------------------------------

    def _copy_out(self, saves: Sequence[SavePlan], reservation: Reservation) -> bool:
        """Copy the reserved chunks' pages into their slots; False if a copy failed."""
        assert self._pages is not None
        sources = self._source_blocks(saves)
        try:
            for chunk_hash, buffer in zip(reservation.hashes, reservation.buffers):
                block_ids = sources[chunk_hash]
                self._pages.copy_chunk_out(block_ids, self._pages.chunk_tensor(buffer))
        except Exception:  # never into vLLM: the chunks are just not stored
            logger.exception("lmcache-svc: copying chunks out failed")
            return False
        return True

    def _source_blocks(self, saves: Sequence[SavePlan]) -> dict[bytes, tuple[int, ...]]:
        bpc = self.blocks_per_chunk
        sources: dict[bytes, tuple[int, ...]] = {}
        for save in saves:
            for i, chunk_hash in enumerate(save.hashes_for(self.tp_rank)):
                sources.setdefault(chunk_hash, save.block_ids[i * bpc : (i + 1) * bpc])
        return sources


def _unique(hashes: Any) -> list[bytes]:
    return list(dict.fromkeys(hashes))

"""Scheduler half: decides what to load and what to save; moves no bytes.

Per request: hash the prompt's full chunks (once, for every tensor-parallel rank), ask the
server in one call how many leading chunks it holds, answer vLLM with the chunk-aligned
hit beyond vLLM's own prefix cache (capped so at least one prompt token is computed), and
turn vLLM's block allocation into a ``LoadPlan``. A request whose prompt vLLM's own prefix
cache already covers up to that cap can load nothing: it is not looked up, and its chunks
are hashed when its first save is planned, a step after its first token. Each step, the
chunks that earlier steps completed become a ``SavePlan``: a chunk is saved one step after
it was computed, so a request's first token never waits for its own save, and a request
that finished first keeps its blocks until the worker has copied them. Chunks the server
already holds are not saved again.

Runs inside vLLM's scheduler loop, so nothing here may block for long or raise. The prompt
is hashed on the scheduler's thread, and answered there when the server's shared lookup
index can tell (same host); otherwise the server is asked on a small thread pool and the
scheduler waits for the answer at most ``tuning.lookup_wait_ms`` and otherwise tells vLLM
"not decided yet" (``None``), which makes vLLM ask again on its next step while it keeps
running the other requests. The lookup itself has a deadline (``lookup_timeout_ms``) after
which it is a miss (``link.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from lmcache_svc.client import LookupResult
from lmcache_svc.errors import InvalidArgument
from lmcache_svc.keys import Namespace, chunk_hashes_packed, pack_token_ids
from lmcache_svc.results import Placement
from lmcache_svc_vllm import trace
from lmcache_svc_vllm.config import ConnectorConfig
from lmcache_svc_vllm.link import ServerLink
from lmcache_svc_vllm.metadata import LoadPlan, SavePlan, StepPlan
from lmcache_svc_vllm.prefetch import PREFETCHES, Prefetches
from lmcache_svc_vllm.pretouch import PageToucher
from lmcache_svc_vllm.save_tokens import describe_save
from lmcache_svc_vllm.stats import StatsRecorder

logger = logging.getLogger(f"vllm.{__name__}")


Hashes = tuple[tuple[bytes, ...], ...]  # [tp_rank][chunk], full prompt chunks only


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    hashes: Hashes
    result: LookupResult | None  # None: the server did not answer in time
    seconds: float  # the lookup call alone


@dataclass(slots=True)
class RequestState:
    """What the scheduler half remembers about one live request."""

    tokens: bytes  # the prompt's token ids, packed (keys.pack_token_ids)
    asked: bool = False  # hashed and looked up (not while vLLM's own hit covers the cap)
    pending: Future[LookupAnswer] | None = None
    started: float = 0.0
    hashes: Hashes = ((),)
    num_hit_chunks: int = 0  # leading chunks the server held at lookup (0 if unknown)
    media: list[str] = field(default_factory=list)  # where each hit chunk is (Tier.medium)
    placement: Placement | None = None  # where in the arena (a lookup the index answered)
    num_saved_chunks: int = 0  # chunks [0, n) are stored or being stored
    load_start: int = 0  # first token of the pending load (vLLM's local hit)
    load_async: bool = False
    loaded_block_ids: tuple[int, ...] = ()
    loaded_first_chunk: int = 0
    loaded_first_block: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.tokens) // 4


class SchedulerSide:
    def __init__(
        self,
        config: ConnectorConfig,
        namespaces: Sequence[Namespace],
        block_size: int,
        link: ServerLink,
        stats: StatsRecorder,
        *,
        load: bool = True,
        save: bool = True,
        prefetches: Prefetches = PREFETCHES,
    ) -> None:
        """``prefetches``: where a worker of this process takes the leases started here."""
        self.config = config
        self.load_enabled, self.save_enabled = load, save
        self.namespaces = list(namespaces)
        self.block_size = block_size
        # The namespaces carry the resolved chunk size (the config's may be unset: default).
        self.chunk_size = self.namespaces[0].chunk_size
        self.blocks_per_chunk = self.chunk_size // block_size
        self.link = link
        self.stats = stats
        self._prefetches = prefetches
        self._toucher = PageToucher()
        self._requests: dict[str, RequestState] = {}
        self._loads: list[LoadPlan] = []
        self._final_saves: list[SavePlan] = []  # of finished requests, for the next step
        self._held: list[str] = []  # their ids: vLLM holds their blocks until they are saved
        self._num_running = 0
        # One thread, started now: a thread's first gRPC call can hold the GIL for tens of
        # milliseconds (measured), which would stall the scheduler thread meanwhile.
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="lmcache-svc-lookup")
        self._lookups.submit(link.connect).result()

    # -- lookup --------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._new_state(request)
            if state is None:
                return 0, False
            self._requests[request.request_id] = state
        cap = self._cap(state)
        if not state.asked and num_computed_tokens < cap:
            self._start_lookup(state)
        if not self._resolve(state):
            return None, False  # vLLM asks again next step
        if not self.load_enabled:
            return 0, False
        hit_tokens = min(state.num_hit_chunks * self.chunk_size, cap)
        num_external = hit_tokens - num_computed_tokens
        if num_external <= 0:
            return 0, False
        state.load_start = num_computed_tokens
        state.load_async = self._use_async(num_external)
        return num_external, state.load_async

    def _new_state(self, request: Any) -> RequestState | None:
        """A request's state, or None when tokens alone do not determine its KV."""
        tokens = _cacheable_prompt(request)
        if tokens is None:
            return None
        return RequestState(tokens)

    def _cap(self, state: RequestState) -> int:
        """The most tokens a hit may cover: whole chunks, at least one token left to compute."""
        chunk = self.chunk_size
        return (state.num_prompt_tokens - 1) // chunk * chunk

    def _start_lookup(self, state: RequestState) -> None:
        """Hash the prompt and answer from the server's lookup index right here when it
        can tell (no round trip: cheaper than waiting for another thread); otherwise the
        server is asked on the lookup thread."""
        state.asked, state.started = True, time.monotonic()
        if state.num_prompt_tokens < self.chunk_size:
            return
        hashes = self._hash(state.tokens)
        start = time.perf_counter()
        local = self.link.lookup_local(hashes[0])
        if local is not None:
            trace.mark("lookup.answered")
            self._apply(state, LookupAnswer(hashes, local, time.perf_counter() - start))
        else:
            state.pending = self._lookups.submit(self.stats.cpu_timed, self._lookup, hashes)

    def _hash_for_saves(self, state: RequestState) -> None:
        """A request that was not looked up (vLLM's own hit covered the cap): its chunks'
        hashes for its saves, and, where the server's lookup index can tell, the leading
        chunks it holds already, which are not saved again (without the index the server
        answers "already stored" for them)."""
        state.asked = True
        state.hashes = self._hash(state.tokens)
        local = self.link.lookup_local(state.hashes[0])
        if local is not None:
            state.num_saved_chunks = local.num_hit_chunks

    def _hash(self, tokens: bytes) -> Hashes:
        """The prompt's full chunks' hashes, for every tensor-parallel rank."""
        hashes = tuple(tuple(chunk_hashes_packed(ns, tokens)) for ns in self.namespaces)
        trace.mark("lookup.hashed")
        return hashes

    def _lookup(self, hashes: Hashes) -> LookupAnswer:
        """On the lookup thread: ask the server about rank 0's chunks."""
        start = time.perf_counter()
        result = self.link.lookup(hashes[0])
        trace.mark("lookup.answered")
        return LookupAnswer(hashes, result, time.perf_counter() - start)

    def _resolve(self, state: RequestState) -> bool:
        """Apply the lookup's answer once it is there; False while it is still out."""
        if state.pending is None:
            return True
        try:
            answer = state.pending.result(timeout=self.config.tuning.lookup_wait_ms / 1000)
        except FutureTimeout:
            overdue = time.monotonic() - state.started > 2 * self.config.lookup_timeout_ms / 1000
            if not overdue:
                trace.mark("lookup.deferred")
                self.stats.add(lookups_deferred=1)
                return False
            state.pending = None  # a stuck lookup thread: give up, a miss
            self.stats.add(lookup_failures=1)
            return True
        except Exception:  # never into vLLM's scheduler: a miss
            logger.exception("lmcache-svc: a lookup failed; its request is a miss")
            state.pending = None
            self.stats.add(lookup_failures=1)
            return True
        state.pending = None
        self._apply(state, answer)
        return True

    def _apply(self, state: RequestState, answer: LookupAnswer) -> None:
        state.hashes = answer.hashes
        chunk = self.chunk_size
        self.stats.time("lookup_seconds", answer.seconds)
        self.stats.add(lookups=1, lookup_query_tokens=len(answer.hashes[0]) * chunk)
        if answer.result is None:
            self.stats.add(lookup_failures=1)
            return
        state.num_hit_chunks = answer.result.num_hit_chunks
        state.media = list(answer.result.media)
        state.placement = answer.result.placement
        state.num_saved_chunks = state.num_hit_chunks
        self.stats.add(lookup_hit_tokens=state.num_hit_chunks * chunk)

    def _use_async(self, num_tokens: int) -> bool:
        mode = self.config.load_mode
        if mode == "auto":
            return num_tokens >= self.config.async_load_min_tokens and self._num_running > 0
        return mode == "async"

    def hit_media(self, request_id: str, num_external_tokens: int) -> dict[str, int]:
        """Tokens of the external hit per medium of the server's tier that held them (for
        vLLM's by-source counters); "" for tokens whose medium is unknown."""
        state = self._requests.get(request_id)
        if state is None or num_external_tokens <= 0:
            return {}
        chunk = self.chunk_size
        end = state.load_start + num_external_tokens
        counts: dict[str, int] = {}
        for i in range(state.load_start // chunk, -(-end // chunk)):
            medium = state.media[i] if i < len(state.media) else ""
            lo, hi = max(i * chunk, state.load_start), min((i + 1) * chunk, end)
            counts[medium] = counts.get(medium, 0) + hi - lo
        return counts

    # -- plans ---------------------------------------------------------------------------

    def update_state_after_alloc(
        self, request: Any, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        start, end = state.load_start, state.load_start + num_external_tokens
        chunk, bs = self.chunk_size, self.block_size
        first_chunk, last_chunk = start // chunk, -(-end // chunk)
        placement = state.placement
        plan = LoadPlan(
            req_id=request.request_id,
            chunk_hashes=tuple(h[first_chunk:last_chunk] for h in state.hashes),
            first_block=(start % chunk) // bs,
            block_ids=tuple(block_ids[start // bs : end // bs]),
            is_async=state.load_async,
            placement=None if placement is None else placement.part(first_chunk, last_chunk),
        )
        state.loaded_block_ids = plan.block_ids
        state.loaded_first_chunk, state.loaded_first_block = first_chunk, plan.first_block
        self._loads.append(plan)
        # A worker in this process: its lease now, while vLLM prepares the step (prefetch.py).
        namespace_id = self.namespaces[0].namespace_id
        if self._prefetches.start(plan.req_id, namespace_id, plan.hashes_for(0), self._submit):
            trace.mark("load.prefetch")  # touched there, with pretouch_loads
        elif self.config.pretouch_loads and plan.placement is not None:
            self._submit(self._pretouch, plan.hashes_for(0), plan.placement)

    def _pretouch(self, hashes: Sequence[bytes], placement: Placement) -> None:
        """On the lookup thread: read one byte of every page of the load's chunks, where the
        lookup found them in the segment, before the worker copies them (``pretouch.py``)."""
        read = self.link.read_in_place(hashes, placement)
        if read is not None and self._toucher.touch(read.buffers) is not None:
            trace.mark("load.pretouched")

    def build_step_plan(self, scheduler_output: Any) -> StepPlan:
        """This step's loads (planned as vLLM allocated their blocks) and saves: the full
        chunks that earlier steps computed, so a chunk is saved one step after the step that
        completed it (a request's first token never waits for its own save), and the chunks
        of requests that finished meanwhile (their blocks held until the worker has copied
        them: ``request_finished``)."""
        plan = StepPlan(
            loads=self._loads,
            saves=self._final_saves,
            held=self._held,
            starts_requests=bool(scheduler_output.scheduled_new_reqs),
        )
        self._loads, self._final_saves, self._held = [], [], []
        self._num_running = len(scheduler_output.num_scheduled_tokens)
        for req_id, num_computed in _continuing_requests(scheduler_output):
            state = self._requests.get(req_id)
            if state is None:
                continue
            save = self._save_plan(
                req_id, state, num_computed, _block_ids(scheduler_output, req_id)
            )
            if save is not None:
                plan.saves.append(save)
        return plan

    def _save_plan(
        self, req_id: str, state: RequestState, num_computed: int, block_ids: Sequence[int] | None
    ) -> SavePlan | None:
        """The full prompt chunks among the first ``num_computed`` tokens (computed by steps
        the worker has run before this one) that are not stored or being stored yet."""
        if not self.save_enabled:
            return None
        num_full = min(num_computed, state.num_prompt_tokens) // self.chunk_size
        if num_full > state.num_saved_chunks and not state.asked:
            self._hash_for_saves(state)
        num_full = min(num_full, len(state.hashes[0]))  # no hashes if the lookup was lost
        start = state.num_saved_chunks
        if num_full <= start:
            return None
        bpc = self.blocks_per_chunk
        if block_ids is None or len(block_ids) < num_full * bpc:
            return None
        state.num_saved_chunks = num_full
        tokens: bytes = b""
        parents: tuple[bytes, ...] = ()
        if self.link.events_source() is not None:  # the server announces them: describe
            tokens, parents = describe_save(
                state.tokens, state.hashes, start, num_full, self.chunk_size
            )
        return SavePlan(
            req_id=req_id,
            chunk_hashes=tuple(h[start:num_full] for h in state.hashes),
            block_ids=tuple(block_ids[start * bpc : num_full * bpc]),
            token_ids=tokens,
            parent_hashes=parents,
        )

    # -- feedback and clean-up -----------------------------------------------------------

    def on_invalid_blocks(self, invalid_block_ids: set[int]) -> None:
        """Loads that failed: those chunks are not in the server after all; save them."""
        bpc = self.blocks_per_chunk
        for state in self._requests.values():
            for i, block_id in enumerate(state.loaded_block_ids):
                if block_id in invalid_block_ids:
                    failed_chunk = state.loaded_first_chunk + (state.loaded_first_block + i) // bpc
                    state.num_saved_chunks = min(state.num_saved_chunks, failed_chunk)
                    state.num_hit_chunks = min(state.num_hit_chunks, failed_chunk)
                    break

    def request_finished(
        self, request_id: str, num_computed_tokens: int, block_ids: Sequence[int]
    ) -> bool:
        """Forget the request; True when it has computed chunks not saved yet: they are
        saved in the next step and vLLM keeps its blocks until the worker reports them
        copied (``WorkerSide.take_saved``)."""
        state = self._requests.pop(request_id, None)
        self._prefetches.discard(request_id)
        if state is None:
            return False
        save = self._save_plan(request_id, state, num_computed_tokens, block_ids)
        if save is None:
            return False
        self._final_saves.append(save)
        self._held.append(request_id)
        return True

    def _submit(self, fn: Any, /, *args: Any) -> Future[Any]:
        return self._lookups.submit(self.stats.cpu_timed, fn, *args)

    def shutdown(self) -> None:
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self.link.close()


def _cacheable_prompt(request: Any) -> bytes | None:
    """The prompt's token ids packed once, for its hashes and its saves' KV events (a copy
    of the list, then packing it, cost a cold lookup twice the reads of the ids); None
    when tokens alone do not determine its KV (or an id is not a uint32)."""
    if request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None:
        return None
    if request.mm_features or request.lora_request is not None or request.cache_salt:
        return None
    try:
        return pack_token_ids(request.prompt_token_ids)
    except InvalidArgument:
        return None


def _continuing_requests(scheduler_output: Any) -> list[tuple[str, int]]:
    """(request id, tokens computed before this step) for every scheduled request that also
    ran in an earlier step (a request's first step saves nothing: its first token first)."""
    cached = scheduler_output.scheduled_cached_reqs
    return list(zip(cached.req_ids, cached.num_computed_tokens))


def _block_ids(scheduler_output: Any, req_id: str) -> list[int] | None:
    block_state = scheduler_output.kv_connector_block_state
    if block_state is None:
        return None
    ids = block_state.get_block_ids(req_id)
    return None if ids is None else list(ids[0])

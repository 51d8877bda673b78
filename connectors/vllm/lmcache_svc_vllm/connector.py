"""``LMCacheSvcConnector``: vLLM's KV connector API, delegated to the two halves.

vLLM creates one instance per role: SCHEDULER (engine core) delegates to
``SchedulerSide``, WORKER (each worker process) to ``WorkerSide``; the halves talk only
through ``LMCacheSvcMetadata``. Nothing here raises into vLLM once the engine is up: an
unsupported engine set-up disables the plugin with one error log, and server faults are
misses (``link.py``).

Every hook vLLM calls is ``timed`` (``hooks.py``): the wall time inside them reaches the
stats as ``scheduler_hook_ns`` / ``worker_hook_ns``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.platforms import current_platform
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from lmcache_svc_vllm import trace
from lmcache_svc_vllm.config import parse_config
from lmcache_svc_vllm.engine import EngineKV, UnsupportedEngine, describe_engine
from lmcache_svc_vllm.events import EngineEvents, start_engine_events
from lmcache_svc_vllm.hooks import HookClock, flush, timed
from lmcache_svc_vllm.link import ServerLink
from lmcache_svc_vllm.metadata import StepPlan
from lmcache_svc_vllm.prefetch import PREFETCHES
from lmcache_svc_vllm.prom import LMCacheSvcPromMetrics, LMCacheSvcStats
from lmcache_svc_vllm.scheduler import SchedulerSide
from lmcache_svc_vllm.stats import FirstTokenHold, StatsRecorder
from lmcache_svc_vllm.worker import WorkerSide

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(f"vllm.{__name__}")

_MEDIUM_SOURCES = {  # a server tier's medium (lookup answers) -> vLLM's hit source
    "host_memory": CacheHitSource.HOST,
    "device": CacheHitSource.DEVICE,
    "disk": CacheHitSource.DISK,
}


@dataclass
class LMCacheSvcMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


class LMCacheSvcConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._config = parse_config(self._kv_transfer_config.kv_connector_extra_config)
        self._stats = StatsRecorder()
        self._stats_hold = FirstTokenHold()
        self._starts_requests = False  # the current step's (StepPlan.starts_requests)
        self._layers_unmarked = False  # tracing: the step's first layer not marked yet
        self.hook_clock = HookClock()
        self._half: Literal["scheduler", "worker"] = (
            "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._kv_events: EngineEvents | None = None
        try:
            engine = describe_engine(
                vllm_config, kv_cache_config, self._config, current_platform.device_type
            )
        except UnsupportedEngine as e:
            logger.error("lmcache-svc plugin disabled: %s", e)
            return
        # The chunk size now that the block size is known (default: from the block size).
        self._config = self._config.for_block_size(engine.block_size)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._make_scheduler(engine)
            self._kv_events = start_engine_events(
                self._scheduler.link, engine.block_size, vllm_config
            )
            self._set_load_failure_policy()
        else:
            self._worker = self._make_worker(engine)

    def _make_scheduler(self, engine: EngineKV) -> SchedulerSide:
        namespaces = engine.namespaces(self._config)
        link = ServerLink(self._config, namespaces[0], f"vllm-scheduler-{os.getpid()}")
        logger.info(
            "lmcache-svc: server %s, namespace %s (model %s, tenant %s, %d-token chunks of "
            "%d bytes)",
            self._config.url or "<default socket>",
            namespaces[0].namespace_id.hex(),
            engine.model_id,
            self._config.tenant,
            namespaces[0].chunk_size,
            namespaces[0].chunk_bytes,
        )
        kv_config = self._kv_transfer_config
        return SchedulerSide(
            self._config,
            namespaces,
            engine.block_size,
            link,
            self._stats,
            load=kv_config.is_kv_consumer,
            save=kv_config.is_kv_producer,
        )

    def _make_worker(self, engine: EngineKV) -> WorkerSide:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank() if engine.tp_size > 1 else 0
        namespace = engine.namespace(self._config, tp_rank)
        link = ServerLink(self._config, namespace, f"vllm-worker-{tp_rank}-{os.getpid()}")
        return WorkerSide(
            namespace,
            link,
            self._stats,
            num_blocks=engine.num_blocks,
            page_order=engine.page_order,
            # the only worker: it may share the scheduler's process (vLLM's UniProcExecutor)
            prefetches=PREFETCHES if engine.tp_size == 1 else None,
        )

    def _set_load_failure_policy(self) -> None:
        """A best-effort cache: a failed load is recomputed, never a failed request."""
        kv_config = self._kv_transfer_config
        if self._config.keep_load_failure_policy or kv_config.kv_load_failure_policy == "recompute":
            return
        logger.info("lmcache-svc: setting kv_load_failure_policy=recompute")
        kv_config.kv_load_failure_policy = "recompute"

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ==============================
    # Worker-side methods
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            self._worker.register_kv_caches(kv_caches)

    @timed
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._layers_unmarked = trace.enabled
        plan = self._plan()
        self._starts_requests = plan.starts_requests
        if self._worker is not None:
            self._worker.bind(plan)

    @timed
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load(self._plan())

    @timed
    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def has_connector_metadata(self) -> bool:
        """Whether this layer of the forward pass calls the per-layer hooks: vLLM asks
        this before each attention layer's ``wait_for_layer_load`` and ``save_kv_layer``
        (and nowhere else). Yes only while the worker has work at the layers
        (``WorkerSide.per_layer``): a step that loads nothing on the CPU, or the layers
        after its load is in, skip two hooks a layer (a miss's decode step on a 4-layer
        model: 9 hook calls, 17 before). With tracing on, the step's first layer is marked
        ``layers>``."""
        if self._layers_unmarked:
            self._layers_unmarked = False
            trace.mark("layers>")
        return self._worker is not None and self._bound() and self._worker.per_layer()

    @timed
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if self._worker is not None and self._bound():
            self._worker.save_layer(layer_name)

    @timed
    def wait_for_save(self) -> None:
        if self._worker is not None and self._bound():
            self._worker.wait_for_save(self._plan())

    @timed
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.take_saved() or None, self._worker.take_finished() or None

    @timed
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    @timed
    def get_kv_connector_stats(self) -> LMCacheSvcStats | None:
        flush(self.hook_clock, self._stats, self._half)  # this call's time: next interval
        data = self._stats_hold.take(self._stats, self._starts_requests)
        return None if data is None else LMCacheSvcStats(data=data)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._kv_events is not None:
            self._kv_events.close()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    def _bound(self) -> bool:
        """A step's metadata is bound (vLLM's meaning of ``has_connector_metadata``)."""
        return super().has_connector_metadata()

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMCacheSvcMetadata), f"unexpected metadata {type(meta)}"
        return meta.plan

    # ==============================
    # Scheduler-side methods
    # ==============================

    @timed
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    @timed
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._scheduler is not None and num_external_tokens > 0:
            block_ids = blocks.get_block_ids()[0]
            self._scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    @timed
    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        if self._scheduler is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        sources: dict[CacheHitSource, int] = {}
        hits = self._scheduler.hit_media(request.request_id, num_external_tokens)
        for medium, n in hits.items():
            source = _MEDIUM_SOURCES.get(medium, CacheHitSource.EXTERNAL_UNSPECIFIED)
            sources[source] = sources.get(source, 0) + n
        return sources

    @timed
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._scheduler is None:
            return LMCacheSvcMetadata()
        plan = self._scheduler.build_step_plan(scheduler_output)
        self._starts_requests = plan.starts_requests  # for this step's stats (update_from_output)
        return LMCacheSvcMetadata(plan)

    @timed
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None and connector_output.invalid_block_ids:
            self._scheduler.on_invalid_blocks(set(connector_output.invalid_block_ids))

    @timed
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        held = self._scheduler.request_finished(
            request.request_id, request.num_computed_tokens, block_ids
        )
        return held, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The sidecar's tiers in this engine's terms (events.py)."""
        return self._kv_events.take() if self._kv_events is not None else ()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LMCacheSvcStats:
        return LMCacheSvcStats(data=data) if data is not None else LMCacheSvcStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> LMCacheSvcPromMetrics:
        return LMCacheSvcPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

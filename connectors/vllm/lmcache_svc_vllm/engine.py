"""What the plugin needs to know about the engine, read once from vLLM's config objects.

Both connector halves build the key namespaces from the same ``EngineKV`` so that the
scheduler's lookups and the worker's copies agree on what a chunk's bytes mean. Reading is
duck-typed (plain attribute access), so this module imports nothing from vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmcache_svc.keys import KVLayout, Namespace
from lmcache_svc_vllm.config import ConnectorConfig
from lmcache_svc_vllm.layout import page_layout_label, page_order_from_layout_name


class UnsupportedEngine(ValueError):
    """An engine set-up the plugin cannot cache for (it then stays out of the way)."""


@dataclass(frozen=True, slots=True)
class EngineKV:
    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    page_order: str
    device_type: str
    tp_size: int
    num_blocks: int

    def layout(self) -> KVLayout:
        return KVLayout(
            dtype=self.dtype,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            block_size=self.block_size,
            page_layout=page_layout_label(self.device_type, self.page_order),
            kv_planes=2,
        )

    def namespace(self, config: ConnectorConfig, tp_rank: int) -> Namespace:
        """The key namespace of one rank; ``config`` must come from ``for_block_size``."""
        return Namespace(
            model=self.model_id,
            layout=self.layout(),
            chunk_size=config.resolved_chunk_size(),
            tp_rank=tp_rank,
            tp_size=self.tp_size,
            tenant=config.tenant,
        )

    def namespaces(self, config: ConnectorConfig) -> list[Namespace]:
        """One namespace per tensor-parallel rank (the scheduler hashes for all of them)."""
        return [self.namespace(config, rank) for rank in range(self.tp_size)]


def describe_engine(
    vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig, device_type: str
) -> EngineKV:
    """Read the KV geometry; raises ``UnsupportedEngine`` naming what is not supported, and
    ``ConfigError`` for a configured ``chunk_size`` that is not a multiple of the block size."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedEngine(
            f"{len(groups)} KV cache groups (hybrid attention); only one full-attention "
            "group is supported"
        )
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ != "FullAttentionSpec":
        raise UnsupportedEngine(f"KV cache spec {type(spec).__name__} is not supported")
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise UnsupportedEngine("K and V head sizes differ")
    layout_name = kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout
    if layout_name is None:
        raise UnsupportedEngine("vLLM did not resolve a KV cache layout")
    page_order = page_order_from_layout_name(layout_name)
    if page_order[0] != "B":
        raise UnsupportedEngine(f"KV layout {layout_name}: pages are not contiguous byte runs")
    config.check_block_size(spec.block_size)
    return EngineKV(
        model_id=config.model_id or _model_id(vllm_config.model_config),
        dtype=str(spec.dtype).removeprefix("torch."),
        num_layers=len(groups[0].layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        block_size=spec.block_size,
        page_order=page_order,
        device_type=device_type,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        num_blocks=kv_cache_config.num_blocks,
    )


def _model_id(model_config: Any) -> str:
    revision = getattr(model_config, "revision", None)
    return f"{model_config.model}@{revision}" if revision else str(model_config.model)

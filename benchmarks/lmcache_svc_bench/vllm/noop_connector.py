"""A KV connector that does nothing, for ``bench hitcost``'s control: what vLLM's own
connector machinery costs an engine, with no cache behind it.

Runs inside an engine (the vLLM venv): ``kv_connector_module_path: noop_connector``. Its
hooks leave the plugin's time marks (``lmcache_svc_vllm/trace.py``) where the plugin's do, so
the benchmark splits its requests into the same phases."""

from __future__ import annotations

from typing import Any

from lmcache_svc_vllm.trace import mark
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NoopConnector(KVConnectorBase_V1):  # type: ignore[misc]
    _layers_unmarked = False

    def bind_connector_metadata(self, m: Any) -> None:
        mark("bind_connector_metadata>")
        super().bind_connector_metadata(m)
        self._layers_unmarked = True

    def has_connector_metadata(self) -> bool:
        """vLLM asks this before each attention layer: the step's first layer is marked."""
        if self._layers_unmarked:
            self._layers_unmarked = False
            mark("layers>")
        return bool(super().has_connector_metadata())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        mark("start_load_kv>")

    def wait_for_layer_load(self, layer_name: str) -> None:
        mark("wait_for_layer_load>")

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        mark("save_kv_layer>")

    def wait_for_save(self) -> None:
        mark("wait_for_save>")

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        mark("get_num_new_matched_tokens>")
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        mark("build_connector_meta>")
        return KVConnectorMetadata()

    def update_connector_output(self, o: Any) -> None:
        mark("update_connector_output>")

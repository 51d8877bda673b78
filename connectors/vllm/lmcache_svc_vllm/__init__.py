"""vLLM KV connector plugin for lmcache-svc (see docs/vllm.md).

Load it with ``--kv-transfer-config '{"kv_connector": "LMCacheSvcConnector",
"kv_connector_module_path": "lmcache_svc_vllm", "kv_role": "kv_both",
"kv_connector_extra_config": {"url": "/run/lmcache-svc.sock"}}'``.

The connector class is imported lazily, so the vLLM-free parts (config, layout, metadata,
stats) can be imported and tested without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LMCacheSvcConnector"]


def __getattr__(name: str) -> Any:
    if name == "LMCacheSvcConnector":
        from lmcache_svc_vllm.connector import LMCacheSvcConnector

        return LMCacheSvcConnector
    raise AttributeError(f"module 'lmcache_svc_vllm' has no attribute {name!r}")

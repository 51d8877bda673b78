"""``KVCacheMemoryConfig``: MemOS's configuration form plus where the service is.

MemOS's form is accepted as is::

    KVCacheMemoryConfig(extractor_llm={"backend": "huggingface",
                                       "config": {"model_name_or_path": "/models/qwen"}})

``model_name_or_path`` must be a local directory (nothing is ever downloaded). The service:
``service_address`` (a gRPC address: ``/path/grpc.sock``, ``unix:/path``, ``host:port``),
``auth_token`` and ``tenant``. Without ``service_address`` the ``LMCACHE_MEMORY_SERVICE``
environment variable is used, and without either the memories stay in this process.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

from lmcache_svc.errors import ConfigError

HF_BACKENDS = ("huggingface", "huggingface_singleton")
ADDRESS_ENV = "LMCACHE_MEMORY_SERVICE"


@dataclass(slots=True)
class HFModelConfig:
    """MemOS's ``HFLLMConfig`` fields; generation here is greedy (``do_sample`` must be off)."""

    model_name_or_path: str
    max_tokens: int = 8192
    add_generation_prompt: bool = True
    remove_think_prefix: bool = False
    do_sample: bool = False
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 50
    default_headers: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        path = self.model_name_or_path
        if not isinstance(path, str) or not os.path.isdir(path):
            raise ConfigError(
                f"model_name_or_path {path!r} is not a local directory: models load only from a "
                "local path (save_pretrained output), nothing is downloaded"
            )
        if self.do_sample:
            raise ConfigError("do_sample=True is not supported: generation here is greedy")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(slots=True)
class LLMConfig:
    backend: str
    config: HFModelConfig

    @classmethod
    def parse(cls, value: LLMConfig | dict[str, Any]) -> LLMConfig:
        if isinstance(value, LLMConfig):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"extractor_llm must be a dict, got {type(value).__name__}")
        backend = value.get("backend")
        if backend not in HF_BACKENDS:
            raise ConfigError(
                f"extractor_llm.backend must be one of {HF_BACKENDS}, got {backend!r}"
            )
        unknown = set(value) - {"backend", "config"}
        if unknown:
            raise ConfigError(f"extractor_llm: unknown keys {sorted(unknown)}")
        return cls(
            backend, _build(HFModelConfig, value.get("config") or {}, "extractor_llm.config")
        )


class KVCacheMemoryConfig:
    __slots__ = (
        "extractor_llm", "memory_filename", "service_address", "auth_token", "tenant", "cube_id",
    )  # fmt: skip

    def __init__(
        self,
        extractor_llm: LLMConfig | dict[str, Any],
        memory_filename: str = "activation_memory.safetensors",
        service_address: str | None = None,
        auth_token: str | None = None,
        tenant: str | None = None,
        cube_id: str | None = None,
    ) -> None:
        self.extractor_llm: LLMConfig = LLMConfig.parse(extractor_llm)
        if not memory_filename or os.sep in memory_filename or memory_filename in (".", ".."):
            raise ConfigError(f"memory_filename must be a plain file name, got {memory_filename!r}")
        self.memory_filename = memory_filename
        self.service_address = service_address or os.environ.get(ADDRESS_ENV) or None
        self.auth_token = auth_token
        self.tenant = tenant
        self.cube_id = cube_id

    @property
    def model_path(self) -> str:
        return self.extractor_llm.config.model_name_or_path


class MemoryConfigFactory:
    """MemOS's ``MemoryConfigFactory(backend="kv_cache", config={...})``."""

    def __init__(self, backend: str, config: dict[str, Any] | KVCacheMemoryConfig) -> None:
        if backend not in ("kv_cache", "vllm_kv_cache"):
            raise ConfigError(f"backend must be 'kv_cache' or 'vllm_kv_cache', got {backend!r}")
        self.backend = backend
        if isinstance(config, KVCacheMemoryConfig):
            self.config = config
        else:
            self.config = _build(KVCacheMemoryConfig, config, "config")


def _build(cls: Any, values: dict[str, Any], where: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a dict, got {type(values).__name__}")
    names = set(inspect.signature(cls).parameters)
    unknown = set(values) - names
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None

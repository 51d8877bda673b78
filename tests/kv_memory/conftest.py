"""Tiny random-weight Llamas written to tmp dirs (nothing downloaded) and memories over them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from lmcache_svc.kv_memory import InProcessBackend, KVCacheMemory, KVCacheMemoryConfig  # noqa: E402
from lmcache_svc.kv_memory.model import LocalModel  # noqa: E402
from lmcache_svc.kv_memory.tiny_model import TinySpec, build_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def plain_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenizer without a chat template."""
    return build_tiny_llama(tmp_path_factory.mktemp("plain") / "tiny")


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same weights, tokenizer with a chat template."""
    return build_tiny_llama(tmp_path_factory.mktemp("chat") / "tiny", chat_template=True)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same config, other random weights: another model identity."""
    return build_tiny_llama(tmp_path_factory.mktemp("other") / "tiny", TinySpec(seed=1))


@pytest.fixture(scope="session")
def plain_model(plain_model_dir: Path) -> LocalModel:
    return LocalModel(str(plain_model_dir))


@pytest.fixture(scope="session")
def chat_model(chat_model_dir: Path) -> LocalModel:
    return LocalModel(str(chat_model_dir))


def memos_config(path: Path, **kw: object) -> KVCacheMemoryConfig:
    """MemOS's configuration form."""
    return KVCacheMemoryConfig(
        extractor_llm={"backend": "huggingface", "config": {"model_name_or_path": str(path)}},
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def make_memory(plain_model: LocalModel) -> Callable[..., KVCacheMemory]:
    """A KVCacheMemory on the in-process backend (a model loaded once per session)."""

    def make(model: LocalModel = plain_model, **kw: object) -> KVCacheMemory:
        return KVCacheMemory(
            memos_config(Path(model.path), **kw), backend=InProcessBackend(), model=model
        )

    return make


@pytest.fixture
def memory(make_memory: Callable[..., KVCacheMemory]) -> KVCacheMemory:
    return make_memory()

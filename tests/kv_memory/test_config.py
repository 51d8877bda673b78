"""KVCacheMemoryConfig: MemOS's form, local paths only, clear errors; the server stays free
of transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_svc.errors import ConfigError
from lmcache_svc.kv_memory import KVCacheMemoryConfig, MemoryConfigFactory


def _llm(path: str, **extra: object) -> dict[str, object]:
    return {"backend": "huggingface", "config": {"model_name_or_path": path, **extra}}


def test_memos_form_is_accepted(plain_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LMCACHE_MEMORY_SERVICE", raising=False)
    config = KVCacheMemoryConfig(extractor_llm=_llm(str(plain_model_dir), max_tokens=32))
    assert config.model_path == str(plain_model_dir)
    assert config.extractor_llm.config.max_tokens == 32
    assert config.service_address is None
    factory = MemoryConfigFactory(
        backend="kv_cache", config={"extractor_llm": _llm(str(plain_model_dir))}
    )
    assert factory.config.memory_filename == "activation_memory.safetensors"


def test_the_service_address_comes_from_the_config_or_the_environment(
    plain_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LMCACHE_MEMORY_SERVICE", "/tmp/x.sock")
    assert (
        KVCacheMemoryConfig(extractor_llm=_llm(str(plain_model_dir))).service_address
        == "/tmp/x.sock"
    )
    config = KVCacheMemoryConfig(extractor_llm=_llm(str(plain_model_dir)), service_address="h:1")
    assert config.service_address == "h:1"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"extractor_llm": _llm("Qwen/Qwen3-0.6B")}, "not a local directory"),
        ({"extractor_llm": {"backend": "openai", "config": {}}}, "extractor_llm.backend"),
        ({"extractor_llm": _llm("."), "memory_filename": "../x"}, "plain file name"),
        ({"extractor_llm": _llm(".", do_sample=True)}, "greedy"),
        ({"extractor_llm": _llm(".", nucleus=1)}, r"unknown keys \['nucleus'\]"),
    ],
)
def test_bad_configs_are_refused_clearly(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KVCacheMemoryConfig(**kwargs)  # type: ignore[arg-type]


def test_the_server_never_imports_the_memory_api() -> None:
    code = (
        "import sys, lmcache_svc.server.app, lmcache_svc.cli; "
        "bad = [m for m in sys.modules "
        "if m.startswith(('transformers', 'lmcache_svc.kv_memory.'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_address_variable_does_not_upset_a_server_started_beside_it() -> None:
    """The server reads every LMCACHE_SVC_* variable as one of its settings: the API's
    variable must not be one (a server started with it set refused to start)."""
    from lmcache_svc.config import load_config
    from lmcache_svc.kv_memory.config import ADDRESS_ENV

    assert load_config(env={ADDRESS_ENV: "/tmp/x.sock"}) is not None

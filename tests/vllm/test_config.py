"""kv_connector_extra_config parsing: defaults, and errors that name the key."""

from __future__ import annotations

import pytest
from lmcache_svc_vllm.config import ConnectorConfig, parse_config

from lmcache_svc.errors import ConfigError


def test_defaults() -> None:
    config = parse_config({})
    assert config == ConnectorConfig()
    assert (config.chunk_size, config.tenant, config.load_mode) == (256, "default", "auto")


def test_all_keys_parse() -> None:
    config = parse_config(
        {
            "url": "127.0.0.1:7000",
            "tenant": "team-a",
            "model_id": "llama-3-8b",
            "chunk_size": 512,
            "lookup_timeout_ms": 20,
            "lookup_wait_ms": 0,
            "rpc_timeout_ms": 500,
            "retry_interval_s": 0.5,
            "load_mode": "async",
            "async_load_min_tokens": 1024,
            "use_shm": False,
            "auth_token": "secret",
            "keep_load_failure_policy": True,
        }
    )
    assert config.lookup_timeout_ms == 20.0 and isinstance(config.lookup_timeout_ms, float)
    assert (config.url, config.load_mode, config.use_shm) == ("127.0.0.1:7000", "async", False)
    assert config.resolved_auth_token() == "secret"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"urll": "/x.sock"}, r"unknown key\(s\) \['urll'\]"),
        ({"chunk_size": "256"}, "chunk_size must be an integer"),
        ({"chunk_size": 0}, "chunk_size must be > 0"),
        ({"use_shm": "yes"}, "use_shm must be true or false"),
        ({"lookup_timeout_ms": True}, "lookup_timeout_ms must be a number"),
        ({"load_mode": "later"}, "load_mode must be one of"),
        ({"tenant": ""}, "tenant must not be empty"),
        ({"retry_interval_s": -1}, "retry_interval_s must be >= 0"),
        ({"lookup_wait_ms": -1}, "lookup_wait_ms must be >= 0"),
        ({"url": 7000}, "url must be a string"),
    ],
)
def test_bad_values_name_the_key(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(extra)


def test_chunk_size_must_fit_the_block_size() -> None:
    parse_config({"chunk_size": 256}).check_block_size(128)
    with pytest.raises(ConfigError, match="multiple of vLLM's block size 128"):
        parse_config({"chunk_size": 192}).check_block_size(128)


def test_auth_token_falls_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_SVC_AUTH_TOKEN", "from-env")
    assert parse_config({}).resolved_auth_token() == "from-env"

"""kv_connector_extra_config parsing: defaults, and errors that name the key."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
from lmcache_svc_vllm.config import ConnectorConfig, Tuning, default_chunk_size, parse_config

from lmcache_svc.errors import ConfigError
from lmcache_svc_bench.vllm_common import BLOCK_SIZE
from lmcache_svc_bench.vllm_ttft import PLUGIN_DEFAULT_CHUNK


def test_defaults() -> None:
    config = parse_config({})
    assert config == ConnectorConfig()
    assert (config.chunk_size, config.tenant, config.load_mode) == (None, "default", "auto")
    assert parse_config({"chunk_size": None}) == config  # null: the default too
    assert parse_config({"tuning": {}}) == parse_config({"tuning": None}) == config
    assert config.tuning == Tuning(lookup_wait_ms=5.0, store_pool_chunks=0)


def test_all_keys_parse() -> None:
    config = parse_config(
        {
            "url": "127.0.0.1:7000",
            "tenant": "team-a",
            "model_id": "llama-3-8b",
            "chunk_size": 512,
            "lookup_timeout_ms": 20,
            "rpc_timeout_ms": 500,
            "retry_interval_s": 0.5,
            "load_mode": "async",
            "async_load_min_tokens": 1024,
            "use_shm": False,
            "pretouch_loads": True,
            "auth_token": "secret",
            "keep_load_failure_policy": True,
            "tuning": {"lookup_wait_ms": 0, "store_pool_chunks": 64},
        }
    )
    assert config.tuning == Tuning(lookup_wait_ms=0.0, store_pool_chunks=64)
    assert config.lookup_timeout_ms == 20.0 and isinstance(config.lookup_timeout_ms, float)
    assert (config.url, config.load_mode, config.use_shm) == ("127.0.0.1:7000", "async", False)
    assert config.resolved_auth_token() == "secret"
    assert config.pretouch_loads is True and ConnectorConfig().pretouch_loads is False


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"urll": "/x.sock"}, r"unknown key\(s\) \['urll'\]"),
        ({"chunk_size": "256"}, "chunk_size must be an integer"),
        ({"chunk_size": 0}, "chunk_size must be > 0"),
        ({"use_shm": "yes"}, "use_shm must be true or false"),
        ({"pretouch_loads": 1}, "pretouch_loads must be true or false"),
        ({"lookup_timeout_ms": True}, "lookup_timeout_ms must be a number"),
        ({"load_mode": "later"}, "load_mode must be one of"),
        ({"tenant": ""}, "tenant must not be empty"),
        ({"retry_interval_s": -1}, "retry_interval_s must be >= 0"),
        ({"tuning": {"lookup_wait_ms": -1}}, r"tuning\.lookup_wait_ms must be >= 0"),
        ({"tuning": {"store_pool_chunks": -1}}, r"tuning\.store_pool_chunks must be >= 0"),
        ({"tuning": {"store_pool_chunks": 1.5}}, "store_pool_chunks must be an integer"),
        ({"tuning": {"lookup_wait": 1}}, r"unknown key\(s\) \['lookup_wait'\] in .*\.tuning"),
        ({"tuning": 5}, "tuning must be a mapping"),
        ({"lookup_wait_ms": 0}, r"\['lookup_wait_ms'\] have moved into its tuning mapping"),
        ({"store_pool_chunks": 8}, r'write \{"tuning": \{"store_pool_chunks": \.\.\.\}\}'),
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
    with pytest.raises(ConfigError, match="chunk_size 200 must be a multiple of .* size 16"):
        parse_config({"chunk_size": 200}).for_block_size(16)


@pytest.mark.parametrize(
    ("block_size", "chunk_size"),
    [(1, 128), (16, 128), (32, 128), (48, 144), (100, 200), (128, 128), (256, 256), (512, 512)],
)
def test_default_chunk_is_the_smallest_block_multiple_of_128_tokens(
    block_size: int, chunk_size: int
) -> None:
    assert default_chunk_size(block_size) == chunk_size
    resolved = parse_config({}).for_block_size(block_size)
    assert resolved.chunk_size == resolved.resolved_chunk_size() == chunk_size


def test_benchmarks_know_the_default() -> None:
    """``bench ttft`` (which cannot import the plugin) counts (b)'s chunks with its own copy."""
    assert default_chunk_size(BLOCK_SIZE) == PLUGIN_DEFAULT_CHUNK


def test_a_configured_chunk_size_is_kept() -> None:
    config = parse_config({"chunk_size": 512})
    assert config.for_block_size(16).resolved_chunk_size() == 512
    assert config.for_block_size(128) == config
    with pytest.raises(ConfigError, match="not resolved"):
        parse_config({}).resolved_chunk_size()
    with pytest.raises(ConfigError, match="block size must be >= 1"):
        default_chunk_size(0)


def test_auth_token_falls_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_SVC_AUTH_TOKEN", "from-env")
    assert parse_config({}).resolved_auth_token() == "from-env"


def test_every_key_is_in_the_docs_table() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "vllm.md").read_text()
    keys = [f.name for f in fields(ConnectorConfig)]
    keys += [f"tuning.{f.name}" for f in fields(Tuning)]
    missing = [k for k in keys if f"| `{k}` |" not in docs]
    assert not missing, f"undocumented keys in docs/vllm.md: {missing}"

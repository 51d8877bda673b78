"""Configuration: defaults, file + env + flag precedence, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lmcache_svc.cache.values import TierPolicy
from lmcache_svc.config import load_config
from lmcache_svc.errors import ConfigError


def test_embedded_defaults_are_safe() -> None:
    cfg = load_config(env={})
    assert cfg.host == "127.0.0.1" and cfg.auth_token is None
    assert int(cfg.cpu.capacity) == 1 << 30 and cfg.cpu.shm_mode == 0o600
    assert cfg.ssd.path is None and cfg.redis.url is None
    assert cfg.socket is not None and cfg.socket.name == "grpc.sock"


def test_file_then_env_then_flags(tmp_path: Path) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("http_port: 9000\ncpu:\n  capacity: 2GiB\nssd:\n  path: /var/tmp/x\n")
    cfg = load_config(
        yaml_file,
        env={"LMCACHE_SVC_CPU__CAPACITY": "3GiB", "LMCACHE_SVC_GRPC_PORT": "6000"},
        overrides={"grpc_port": "7000"},
    )
    assert cfg.http_port == 9000 and int(cfg.cpu.capacity) == 3 << 30
    assert cfg.grpc_port == 7000 and str(cfg.ssd.path) == "/var/tmp/x"
    toml_file = tmp_path / "c.toml"
    toml_file.write_text('[redis]\nurl = "redis://127.0.0.1:6380"\nttl_s = 60\n')
    cfg = load_config(toml_file, env={"LMCACHE_SVC_HTTP_PORT": "null"})
    assert cfg.redis.url == "redis://127.0.0.1:6380" and cfg.http_port is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LMCACHE_SVC_CPU__CAPACITY": "lots"}, "cpu.capacity"),
        ({"LMCACHE_SVC_CPU__COLOUR": "red"}, "cpu.colour"),
        ({"LMCACHE_SVC_HTTP_PORT": "70000"}, "http_port"),
        ({"LMCACHE_SVC_REDIS__URL": "http://x"}, "redis://"),
        ({"LMCACHE_SVC_CACHE__LOW_WATERMARK": "0.99"}, "low_watermark"),
        ({"LMCACHE_SVC_CACHE__RESERVATION_TTL_S": "600"}, "max_reservation_ttl_s"),
        ({"LMCACHE_SVC_CACHE__MAX_RESERVED_FRACTION": "0"}, "max_reserved_fraction"),
        ({"LMCACHE_SVC_TUNING__CHECKSUM_QUIET_S": "-1"}, "tuning.checksum_quiet_s"),
        ({"LMCACHE_SVC_TUNING__CHECKSUM_MAX_DELAY_S": "soon"}, "tuning.checksum_max_delay_s"),
        ({"LMCACHE_SVC_TUNING__LOOKUP_INDEX_SLOTS": "1000"}, "power of two"),
        ({"LMCACHE_SVC_HOST": "0.0.0.0"}, "auth_token"),
        ({"LMCACHE_SVC_AUTH_TOKEN": "short"}, "16 characters"),
        (
            {
                "LMCACHE_SVC_HTTP_PORT": "null",
                "LMCACHE_SVC_GRPC_PORT": "null",
                "LMCACHE_SVC_SOCKET": "null",
            },
            "no listener",
        ),
    ],
)
def test_bad_values_name_the_field(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(env=env)


def test_exposed_host_is_allowed_with_a_token() -> None:
    cfg = load_config(
        env={"LMCACHE_SVC_HOST": "0.0.0.0", "LMCACHE_SVC_AUTH_TOKEN": "a-long-enough-token"}
    )
    assert cfg.host == "0.0.0.0"


def test_unreadable_or_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("cpu: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid"):
        load_config(bad, env={})
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy, env={})


def test_every_setting_is_documented() -> None:
    from pydantic import BaseModel

    from lmcache_svc.config import Config

    docs = (Path(__file__).resolve().parents[1] / "docs/configuration.md").read_text()

    def keys(model: type[BaseModel], prefix: str = "") -> list[str]:
        out: list[str] = []
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                out += keys(ann, f"{prefix}{name}.")
            else:
                out.append(prefix + name)
        return out

    missing = [k for k in keys(Config) if f"| `{k}` |" not in docs]
    assert not missing, f"undocumented settings in docs/configuration.md: {missing}"


@pytest.mark.parametrize(("timeout_s", "slow_call_s"), [(2.0, 1.0), (1.0, 0.5), (0.2, 0.1)])
def test_redis_slow_call_is_derived_from_its_timeout(timeout_s: float, slow_call_s: float) -> None:
    cfg = load_config(env={"LMCACHE_SVC_REDIS__TIMEOUT_S": str(timeout_s)})
    assert TierPolicy.from_config(cfg.redis).slow_call_s == slow_call_s


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("cache.checksum_quiet_s", "tuning.checksum_quiet_s"),
        ("cache.checksum_max_delay_s", "tuning.checksum_max_delay_s"),
        ("cpu.lookup_index_slots", "tuning.lookup_index_slots"),
        ("cpu.lookup_index_tenants", "tuning.lookup_index_tenants"),
    ],
)
def test_a_moved_key_names_its_new_place_from_every_source(
    tmp_path: Path, old: str, new: str
) -> None:
    section, leaf = old.split(".")
    env_old = "LMCACHE_SVC_" + old.upper().replace(".", "__")
    env_new = "LMCACHE_SVC_" + new.upper().replace(".", "__")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({section: {leaf: 16}}))
    for source in (
        lambda: load_config(path, env={}),
        lambda: load_config(env={env_old: "16"}),
        lambda: load_config(env={}, overrides={old: 16}),
    ):
        with pytest.raises(ConfigError) as e:
            source()
        assert str(e.value) == f"{old} ({env_old}) has moved to {new} ({env_new}): set it there"
    assert getattr(load_config(env={env_new: "16"}).tuning, new.split(".")[1]) == 16


def test_the_removed_redis_slow_call_key_says_what_replaces_it() -> None:
    with pytest.raises(ConfigError, match=r"redis\.slow_call_s .* was removed: .*redis\.timeout_s"):
        load_config(env={"LMCACHE_SVC_REDIS__SLOW_CALL_S": "0.5"})


def test_tier_policies_come_from_their_sections() -> None:
    cfg = load_config(
        env={
            "LMCACHE_SVC_REDIS__BREAKER_BACKOFF_S": "2",
            "LMCACHE_SVC_REDIS__BREAKER_MAX_BACKOFF_S": "40",
            "LMCACHE_SVC_REDIS__TIMEOUT_S": "6",
            "LMCACHE_SVC_REDIS__ACCEPT_DEMOTIONS": "false",
            "LMCACHE_SVC_SSD__WRITE_THROUGH": "true",
            "LMCACHE_SVC_HBM__ACCEPT_DEMOTIONS": "false",
        }
    )
    assert TierPolicy.from_config(cfg.redis) == TierPolicy(
        accept_demotions=False, write_through=True, backoff_s=2, max_backoff_s=40, slow_call_s=1
    )  # half the timeout, at most 1 s
    assert TierPolicy.from_config(cfg.ssd) == TierPolicy(accept_demotions=True, write_through=True)
    assert TierPolicy.from_config(cfg.hbm) == TierPolicy(accept_demotions=False)


@pytest.mark.parametrize("levels", [65, 50_000])
def test_deeply_nested_yaml_is_refused_not_a_crash(tmp_path: Path, levels: int) -> None:
    # 50,000 levels crashed the process (SIGSEGV in libyaml 0.2.5's C loader, which PyYAML
    # up to 6.0.3 bundles); 65 is past MAX_YAML_NESTING on every PyYAML.
    path = tmp_path / "deep.yaml"
    path.write_text("cpu: " + "[" * levels + "]" * levels)
    with pytest.raises(ConfigError, match="deep.yaml") as e:
        load_config(path=path)
    if levels == 65:
        assert "nested too deeply" in str(e.value) and "64 levels" in str(e.value)


def test_nesting_at_the_limit_is_read(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("cpu: {}\nx: " + "[" * 63 + "]" * 63)
    with pytest.raises(ConfigError) as e:  # read, then refused for the unknown key x
        load_config(path=path)
    assert "nested" not in str(e.value)


def test_the_plugin_s_and_the_tests_variables_are_not_server_settings() -> None:
    """An environment shared with an engine (``LMCACHE_SVC_VLLM_TRACE``) starts the server;
    another unknown ``LMCACHE_SVC_`` variable still stops it, by name."""
    env = {"LMCACHE_SVC_VLLM_TRACE": "/tmp/t", "LMCACHE_SVC_TEST_KILL_FILE": "/tmp/k"}
    assert load_config(env=env) == load_config(env={})
    with pytest.raises(ConfigError, match="vllmx"):
        load_config(env={"LMCACHE_SVC_VLLMX": "1"})

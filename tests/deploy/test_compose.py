"""docker-compose.yml: valid for docker-compose, and every service agrees with what the
server, the plugin, vLLM, Prometheus and Grafana actually accept.

No Docker engine is needed: `docker-compose config` (Debian's docker-compose, installed by
scripts/setup_ops.sh) validates the file; the server's command, environment and mounted
config go through `lmcache-svc serve`'s own parser and ``load_config``; the engines' command
lines through vLLM's parser (from .venv-vllm) and the plugin's config parser.
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from lmcache_svc.config import Config
from tests.deploy.compose import COMPOSE_FILE, PROFILES, SERVER, Compose
from tests.deploy.manifests import (
    REPO,
    connector_config,
    kv_transfer_json,
    parse_engine_args,
    parse_size,
    server_config,
    socket_of,
)

TOKEN = "t" * 32
ENGINE_ALIAS = "engine"
PROMETHEUS_YML = REPO / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA_DIR = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "lmcache-svc.json"


def docker_compose(*args: str, env: dict[str, str] | None = None) -> str:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not on PATH (scripts/setup_ops.sh installs it)")
    done = subprocess.run(
        [binary, "-f", str(COMPOSE_FILE), *args], capture_output=True, text=True, timeout=60,
        cwd=REPO, env={"PATH": "/usr/bin:/bin", **(env or {})},
    )  # fmt: skip
    assert done.returncode == 0, f"docker-compose {' '.join(args)} failed:\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def compose() -> Compose:
    return Compose()


@pytest.fixture(scope="module")
def config(compose: Compose) -> Config:
    return server_config(compose.server_invocation())


BAD_ENGINE_ARGV = ["--model", "m", "--no-such-flag"]


@pytest.fixture(scope="module")
def vllm_parsed(compose: Compose) -> dict[str, dict[str, Any]] | None:
    """vLLM's parser's verdict on every engine service (and on one bad argv, as a control),
    in one run of .venv-vllm's python; None when that venv is missing."""
    engines = compose.all_engines()
    parsed = parse_engine_args([*(compose.engine_argv(e) for e in engines), BAD_ENGINE_ARGV])
    return None if parsed is None else dict(zip([*engines, "bad"], parsed, strict=True))


# -- docker-compose itself -------------------------------------------------------------------------


@pytest.mark.parametrize("profile", PROFILES)
def test_docker_compose_accepts_each_profile(profile: str) -> None:
    docker_compose("--profile", profile, "config", "--quiet")


def test_docker_compose_lists_both_profiles() -> None:
    assert set(docker_compose("config", "--profiles").split()) == set(PROFILES)


def test_docker_compose_resolves_variables_as_these_tests_do(compose: Compose) -> None:
    resolved = yaml.safe_load(docker_compose("config"))["services"]
    for name, service in compose.services.items():
        for key in ("command", "entrypoint", "environment", "shm_size", "ipc"):
            if key in service:
                assert resolved[name][key] == service[key], f"{name}.{key}"


# -- the server ------------------------------------------------------------------------------------


def test_server_service_starts_with_a_valid_config(compose: Compose, config: Config) -> None:
    # Compose sets the arena, SSD and Redis tiers by environment over the mounted file.
    assert config.cpu.capacity == 4 << 30
    assert config.ssd.path == Path("/var/lib/lmcache-svc/ssd")
    assert config.redis.url == "redis://redis:6379/0"
    assert config.auth_token is None and config.allow_unauthenticated
    mount = compose.mount_at(SERVER, "/etc/lmcache-svc/config.yaml")
    assert mount is not None and mount.read_only


def test_a_token_from_the_environment_reaches_server_and_engines() -> None:
    compose = Compose({"LMCACHE_SVC_AUTH_TOKEN": TOKEN})
    assert server_config(compose.server_invocation()).auth_token == TOKEN
    for profile in PROFILES:
        for engine in compose.engines(profile):
            assert compose.env(engine)["LMCACHE_SVC_AUTH_TOKEN"] == TOKEN


def test_an_unknown_key_or_flag_in_compose_fails_the_check(compose: Compose) -> None:
    bad_env = compose.server_invocation()
    bad_env.env["LMCACHE_SVC_CPU__CAPCITY"] = "1GiB"
    with pytest.raises(AssertionError, match="capcity"):
        server_config(bad_env)
    bad_flag = compose.server_invocation()
    bad_flag.argv.append("--arena-bytes=1GiB")
    with pytest.raises(AssertionError, match="--arena-bytes"):
        server_config(bad_flag)


def test_server_directories_are_volumes(compose: Compose, config: Config) -> None:
    assert config.socket is not None and config.ready_file is not None
    assert config.ssd.path is not None
    for path in (config.socket.parent, config.ssd.path):
        mount = compose.mount_at(SERVER, str(path))
        assert mount is not None and not mount.is_bind, f"{path} is not on a named volume"
    assert config.ready_file.parent == config.socket.parent
    # The image's HEALTHCHECK reads the ready file at its default path.
    stage = compose.dockerfile.stage("server")
    assert stage.healthcheck[-1].endswith("healthcheck.py") and len(stage.healthcheck) == 2
    healthcheck = (REPO / "deploy" / "docker" / "healthcheck.py").read_text()
    assert f'DEFAULT_READY_FILE = "{config.ready_file}"' in healthcheck


def test_shared_memory_holds_the_arena(compose: Compose, config: Config) -> None:
    server = compose.service(SERVER)
    assert server["ipc"] == "shareable"
    shm = parse_size(server["shm_size"], "docker")
    assert shm >= int(config.cpu.capacity) + (1 << 30), "shm_size < arena + 1 GiB for vLLM"


def test_redis_is_a_cache_without_persistence_sized_above_the_tier(
    compose: Compose, config: Config
) -> None:
    redis = compose.service("redis")
    args = redis["command"]
    option = {args[i]: args[i + 1] for i in range(1, len(args) - 1) if args[i].startswith("--")}
    assert option["--save"] == "" and option["--appendonly"] == "no"
    assert option["--maxmemory-policy"] == "allkeys-lru"
    assert parse_size(option["--maxmemory"], "redis") >= 1.1 * int(config.redis.capacity)
    assert urlsplit(config.redis.url).hostname == "redis"
    assert (urlsplit(config.redis.url).port or 6379) == 6379
    assert "redis" in compose.service(SERVER)["depends_on"]


# -- the engines -----------------------------------------------------------------------------------


@pytest.mark.parametrize("profile", PROFILES)
def test_each_profile_runs_one_engine_named_engine(compose: Compose, profile: str) -> None:
    engines = compose.engines(profile)
    assert len(engines) == 1, f"profile {profile}: engines {engines}"
    service = compose.service(engines[0])
    assert service["profiles"] == [profile]
    assert ENGINE_ALIAS in service["networks"]["default"]["aliases"]
    assert SERVER in compose.active(profile) and "redis" in compose.active(profile)


def test_engines_agree_with_vllm_the_plugin_and_the_server(
    compose: Compose, config: Config, vllm_parsed: dict[str, dict[str, Any]] | None
) -> None:
    for name in compose.all_engines():
        where = f"docker-compose.yml service {name}"
        kv = kv_transfer_json(compose.argv(name), where)
        if vllm_parsed is not None:  # vLLM's own parser accepts every flag and the JSON
            verdict = vllm_parsed[name]
            assert verdict["ok"], f"{where}: vLLM rejects its command:\n{verdict['error']}"
            assert verdict["kv_transfer_config"] == kv
            assert verdict["port"] == compose.engine_port(name)
        plugin = connector_config(kv, where)
        assert socket_of(plugin.url) == str(config.socket), f"{where}: url {plugin.url}"
        assert compose.service(name)["ipc"] == f"service:{SERVER}"
        assert config.socket is not None
        socket_dir = str(config.socket.parent)
        mine, servers = compose.mount_at(name, socket_dir), compose.mount_at(SERVER, socket_dir)
        assert mine is not None and servers is not None and mine.source == servers.source
        assert mine.target == servers.target, f"{where}: socket volume at another path"
        assert compose.service(name)["depends_on"][SERVER]["condition"] == "service_healthy"
        extra_vars = {k for k in compose.env(name) if k.startswith("LMCACHE_SVC_")}
        assert extra_vars <= {"LMCACHE_SVC_AUTH_TOKEN"}, (
            f"{where}: the plugin reads no {extra_vars}"
        )


def test_engine_images_match_the_dockerfile(compose: Compose) -> None:
    for name in compose.all_engines():
        stage = compose.image_stage(name)
        if stage.entrypoint:  # an image with its own entrypoint runs the same program
            assert compose.entrypoint(name) == stage.entrypoint, name


def test_vllm_args_check_rejects_a_bad_flag(
    vllm_parsed: dict[str, dict[str, Any]] | None,
) -> None:
    if vllm_parsed is None:
        pytest.skip(".venv-vllm is missing (scripts/setup_vllm.sh creates it)")
    bad = vllm_parsed["bad"]
    assert not bad["ok"] and "unrecognized arguments: --no-such-flag" in bad["error"]


# -- ports -----------------------------------------------------------------------------------------


def test_published_ports_bind_to_loopback_by_default(compose: Compose, config: Config) -> None:
    for name in compose.services:
        for port in compose.ports(name):
            assert ipaddress.ip_address(port.host_ip).is_loopback, f"{name}: {port}"
    published = {p.container_port for p in compose.ports(SERVER)}
    assert {config.http_port, config.grpc_port} <= published
    for name in ("redis", "redis-exporter"):
        assert not compose.ports(name), f"{name} needs no published port"
    for name in compose.all_engines():
        assert compose.engine_port(name) in {p.container_port for p in compose.ports(name)}


def test_bind_address_is_one_setting() -> None:
    opened = Compose({"BIND_ADDRESS": "0.0.0.0"})
    assert {p.host_ip for n in opened.services for p in opened.ports(n)} == {"0.0.0.0"}


# -- Prometheus and Grafana ------------------------------------------------------------------------


def scrape_targets() -> dict[str, list[str]]:
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    return {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in config["scrape_configs"]
    }


def test_prometheus_scrapes_what_the_services_serve(compose: Compose, config: Config) -> None:
    targets = scrape_targets()
    assert targets["lmcache-svc"] == [f"{SERVER}:{config.http_port}"]
    for name in compose.all_engines():
        assert targets["vllm"] == [f"{ENGINE_ALIAS}:{compose.engine_port(name)}"]
    assert targets["redis"] == ["redis-exporter:9121"]  # redis_exporter's default port
    assert compose.env("redis-exporter")["REDIS_ADDR"] == "redis://redis:6379"


def test_prometheus_config_is_valid_and_mounted(compose: Compose) -> None:
    mount = compose.mount_at("prometheus", "/etc/prometheus/prometheus.yml")
    assert mount is not None and mount.host_path() == PROMETHEUS_YML.parent and mount.read_only
    flags = dict(a.split("=", 1) for a in compose.argv("prometheus"))
    assert flags["--config.file"] == "/etc/prometheus/prometheus.yml"
    promtool = shutil.which("promtool")
    prometheus = shutil.which("prometheus")
    if promtool is None or prometheus is None:
        pytest.skip("prometheus/promtool are not on PATH (scripts/setup_ops.sh installs them)")
    done = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_YML)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    usage = subprocess.run([prometheus, "--help"], capture_output=True, text=True, timeout=30)
    for flag in flags:
        assert flag in usage.stdout + usage.stderr, f"prometheus does not know {flag}"


def test_grafana_is_provisioned_without_clicks(compose: Compose) -> None:
    files = compose.container_files("grafana")
    env = compose.env("grafana")
    assert Path(files[env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]]) == DASHBOARD
    providers = yaml.safe_load(
        (GRAFANA_DIR / "provisioning" / "dashboards" / "lmcache-svc.yaml").read_text()
    )["providers"]
    provided = {c for p in providers for c in files if c.startswith(p["options"]["path"] + "/")}
    assert any(files[c] == DASHBOARD for c in provided), "the provider does not load the dashboard"
    sources = yaml.safe_load(
        (GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )["datasources"]
    assert any(c.startswith("/etc/grafana/provisioning/datasources/") for c in files)
    (source,) = sources
    assert source["type"] == "prometheus" and source["isDefault"]
    assert source["url"] == "http://prometheus:9090"  # Prometheus's default listen port
    assert (
        source["jsonData"]["timeInterval"]
        == yaml.safe_load(PROMETHEUS_YML.read_text())["global"]["scrape_interval"]
    )
    dashboard = json.loads(DASHBOARD.read_text())
    (variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert variable["current"]["value"] == source["uid"]

"""Kubernetes manifests (deploy/k8s): they parse, reference each other consistently, and
their containers' args, env and config agree with the server's CLI and config and the
plugin's config, the same way as the compose file (no cluster here).

Each layout is read as `kubectl apply -k` would assemble it: a kustomization's resources,
following ``../common``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmcache_svc.config import Config
from tests.deploy.manifests import (
    REPO,
    ServerInvocation,
    connector_config,
    engine_argv,
    kv_transfer_json,
    parse_engine_args,
    parse_size,
    server_config,
    socket_of,
)

K8S = REPO / "deploy" / "k8s"
LAYOUTS = ("daemonset", "sidecar")
SERVER_IMAGE = "lmcache-svc:"
TOKEN = "k" * 32  # stands in for the Secret's value
WORKLOADS = {"DaemonSet", "Deployment", "StatefulSet"}


def kustomize(directory: Path) -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for resource in kustomization["resources"]:
        path = (directory / resource).resolve()
        if path.is_dir():
            docs += kustomize(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


@pytest.fixture(scope="module")
def vllm_parsed() -> dict[tuple[str, str], dict[str, Any]] | None:
    """vLLM's parser's verdict on every engine container of every layout, in one run."""
    engines = [
        (layout, where, c)
        for layout in LAYOUTS
        for where, _, spec in pod_specs(kustomize(K8S / layout))
        for c in engine_containers(spec)
    ]
    parsed = parse_engine_args([engine_argv(c["command"], c["args"]) for *_, c in engines])
    if parsed is None:
        return None
    return {(layout, f"{where}/{c['name']}"): r for (layout, where, c), r in zip(engines, parsed)}


@pytest.fixture(scope="module", params=LAYOUTS)
def layout(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, kustomize(K8S / request.param)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    for d in docs:
        if d["kind"] in WORKLOADS:
            template = d["spec"]["template"]
            yield f"{d['kind']}/{d['metadata']['name']}", template["metadata"], template["spec"]


def all_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def server_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        c
        for c in all_containers(spec)
        if c["image"].startswith(SERVER_IMAGE) and c.get("args", [None])[0] == "serve"
    ]


def engine_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in spec["containers"] if "--kv-transfer-config" in c.get("args", [])]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """Literal env values; a secretKeyRef (the auth token) stands in as TOKEN."""
    out = {}
    for item in container.get("env", []):
        if "value" in item:
            out[item["name"]] = str(item["value"])
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == ("lmcache-svc-auth", "token"), item
            out[item["name"]] = TOKEN
    return out


def mounted_files(
    container: dict[str, Any], spec: dict[str, Any], docs: list[dict[str, Any]]
) -> dict[str, str]:
    """Container path -> text of each ConfigMap key mounted in the container."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    maps = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    out = {}
    for mount in container.get("volumeMounts", []):
        source = volumes[mount["name"]].get("configMap")
        if source is None:
            continue
        for key, text in maps[source["name"]]["data"].items():
            out[f"{mount['mountPath']}/{key}"] = text
    return out


def server_of(
    container: dict[str, Any],
    spec: dict[str, Any],
    docs: list[dict[str, Any]],
    where: str,
    tmp: Path,
) -> Config:
    assert "command" not in container, f"{where}: keep the image's ENTRYPOINT (lmcache-svc)"
    files = {}
    for i, (path, text) in enumerate(mounted_files(container, spec, docs).items()):
        copy = tmp / f"mounted-{i}.yaml"
        copy.write_text(text)
        files[path] = copy
    inv = ServerInvocation(where, list(container["args"]), env_of(container), files)
    return server_config(inv)


def mount_source(spec: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume (as a dict) mounted at exactly ``path`` in ``container``."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in container.get("volumeMounts", []):
        if mount["mountPath"] == path:
            volume = dict(volumes[mount["name"]])
            volume.pop("name")
            return volume
    raise AssertionError(f"{container['name']} mounts nothing at {path}")


def same_storage(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if "hostPath" in a and "hostPath" in b:
        return bool(a["hostPath"]["path"] == b["hostPath"]["path"])
    return a == b


# -- structure -------------------------------------------------------------------------------------


def test_every_document_is_well_formed(layout: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = layout
    seen = set()
    for d in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(d), d
        key = (d["kind"], d["metadata"]["name"])
        assert key not in seen, f"{name}: {key} twice"
        seen.add(key)
    kinds = {d["kind"] for d in docs}
    assert {"ConfigMap", "Service", "ServiceMonitor", "PrometheusRule"} <= kinds


def test_volume_mounts_ports_and_probes_resolve(layout: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = layout
    for where, _, spec in pod_specs(docs):
        volumes = {v["name"] for v in spec.get("volumes", [])}
        port_names = [p["name"] for c in all_containers(spec) for p in c.get("ports", [])]
        assert len(port_names) == len(set(port_names)), f"{where}: port names clash in the pod"
        for c in all_containers(spec):
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{where}/{c['name']}: {mount['name']}"
            mine = {p["name"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if probe in c:
                    assert c[probe]["httpGet"]["port"] in mine, f"{where}/{c['name']} {probe}"


def test_services_select_pods_and_monitors_select_services(
    layout: tuple[str, list[dict[str, Any]]],
) -> None:
    name, docs = layout
    pods = list(pod_specs(docs))
    for service in by_kind(docs, "Service"):
        selector = service["spec"]["selector"]
        matched = [
            (labels, spec)
            for _, labels, spec in pods
            if selector.items() <= labels["labels"].items()
        ]
        assert matched, f"{name}: Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            for _, spec in matched:
                names = {p["name"] for c in all_containers(spec) for p in c.get("ports", [])}
                assert port["targetPort"] in names, f"{name}: {port} has no container port"
    for monitor in by_kind(docs, "ServiceMonitor"):
        wanted = monitor["spec"]["selector"]["matchLabels"]
        services = [
            s for s in by_kind(docs, "Service") if wanted.items() <= s["metadata"]["labels"].items()
        ]
        assert len(services) == 1, f"{name}: {monitor['metadata']['name']} selects {services}"
        ports = {p["name"] for p in services[0]["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports


def test_workload_selectors_match_their_templates(
    layout: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = layout
    for d in docs:
        if d["kind"] in WORKLOADS:
            selector = d["spec"]["selector"]["matchLabels"]
            assert selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()


def test_alert_rules_match_the_compose_prometheus() -> None:
    rule = by_kind(kustomize(K8S / "daemonset"), "PrometheusRule")[0]
    alerts = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"] == alerts


# -- the server and the engines against the CLI, config and plugin ---------------------------------


def test_server_containers_start_with_valid_configs(
    layout: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    name, docs = layout
    found = 0
    for where, labels, spec in pod_specs(docs):
        for c in server_containers(spec):
            found += 1
            config = server_of(c, spec, docs, f"{name}: {where}/{c['name']}", tmp_path)
            assert config.auth_token == TOKEN, "the pod network needs the token"
            assert labels["labels"].get("lmcache-svc/server") == "true"
            http = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert http == {"http": config.http_port, "grpc": config.grpc_port}
            check_memory(c, spec, config, where)
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] and sc["runAsUser"] != 0 and sc["readOnlyRootFilesystem"]
            for path in (config.socket, config.ready_file, config.ssd.path):
                if path is not None:  # written paths live on volumes (read-only root fs)
                    assert any(
                        str(path).startswith(m["mountPath"] + "/") or str(path) == m["mountPath"]
                        for m in c["volumeMounts"]
                    )
    assert found == 1, f"{name}: {found} lmcache-svc containers"


def check_memory(c: dict[str, Any], spec: dict[str, Any], config: Config, where: str) -> None:
    """The arena fits the container's memory limit, and /dev/shm when that is an emptyDir."""
    arena = int(config.cpu.capacity)
    limit = parse_size(c["resources"]["limits"]["memory"], "k8s")
    assert limit >= arena + (1 << 30), f"{where}: memory limit < arena + 1 GiB"
    shm = mount_source(spec, c, "/dev/shm")
    if "emptyDir" in shm:
        assert shm["emptyDir"]["medium"] == "Memory"
        assert parse_size(shm["emptyDir"]["sizeLimit"], "k8s") >= arena + (1 << 30)
    else:
        assert shm["hostPath"]["path"] == "/dev/shm"


def test_engines_share_socket_and_shared_memory_with_the_server(
    layout: tuple[str, list[dict[str, Any]]],
    tmp_path: Path,
    vllm_parsed: dict[tuple[str, str], dict[str, Any]] | None,
) -> None:
    name, docs = layout
    servers = [(c, spec) for _, _, spec in pod_specs(docs) for c in server_containers(spec)]
    ((server, server_spec),) = servers
    config = server_of(server, server_spec, docs, name, tmp_path)
    assert config.socket is not None
    engines = [(w, c, spec) for w, _, spec in pod_specs(docs) for c in engine_containers(spec)]
    assert engines, f"{name}: no engine"
    for workload, c, spec in engines:
        where = f"{name}: {workload}/{c['name']}"
        kv = kv_transfer_json(c["args"], where)
        if vllm_parsed is not None:
            verdict = vllm_parsed[(name, f"{workload}/{c['name']}")]
            assert verdict["ok"], f"{where}: vLLM rejects its args:\n{verdict['error']}"
            assert verdict["kv_transfer_config"] == kv
        plugin = connector_config(kv, where)
        assert socket_of(plugin.url) == str(config.socket), where
        socket_dir = str(config.socket.parent)
        assert same_storage(
            mount_source(spec, c, socket_dir), mount_source(server_spec, server, socket_dir)
        ), where
        assert same_storage(
            mount_source(spec, c, "/dev/shm"), mount_source(server_spec, server, "/dev/shm")
        ), where
        assert env_of(c).get("LMCACHE_SVC_AUTH_TOKEN") == TOKEN, f"{where}: no token"


def test_daemonset_clears_only_its_own_stale_segment(tmp_path: Path) -> None:
    docs = kustomize(K8S / "daemonset")
    ((_, _, spec),) = [p for p in pod_specs(docs) if p[0] == "DaemonSet/lmcache-svc"]
    (server,) = server_containers(spec)
    config = server_of(server, spec, docs, "daemonset", tmp_path)
    assert config.cpu.shm_name is not None
    (init,) = [c for c in spec["initContainers"] if c is not server]
    script = init["command"][-1]
    assert f"rm -f /dev/shm/{config.cpu.shm_name}" in script
    assert config.ssd.path is not None and config.socket is not None
    assert f"chown 10001:10001 {config.socket.parent} {config.ssd.path}" in script
    assert server["securityContext"]["runAsUser"] == 10001

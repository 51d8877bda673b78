"""Read the deployment files the way their tools do, and check them against the real CLIs.

- ``interpolate``: docker compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
  ``${VAR:?message}`` and ``$$``.
- ``Dockerfile``: stages, ENV, COPY, ENTRYPOINT/CMD, HEALTHCHECK of a Dockerfile.
- ``server_config``: a server's command line, environment and mounted files, validated by
  ``lmcache-svc serve``'s own parser and ``load_config`` (an unknown flag, config key or
  ``LMCACHE_SVC_*`` variable fails).
- ``parse_engine_args``: engine command lines, parsed by vLLM's own parser when
  ``.venv-vllm`` exists, and their ``kv_connector_extra_config`` by the plugin's parser.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lmcache_svc import cli
from lmcache_svc.config import Config, load_config
from tests.helpers import import_plugin_from_source

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
import_plugin_from_source()

from lmcache_svc_vllm.config import ConnectorConfig, parse_config  # noqa: E402

CONNECTOR_CLASS = "LMCacheSvcConnector"
CONNECTOR_MODULE = "lmcache_svc_vllm"

# -- docker compose variable interpolation ---------------------------------------------------------

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """``value`` with compose variables substituted from ``env``, recursively."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value
    return _VARIABLE.sub(lambda m: _substitute(m, env), value)


def _substitute(m: re.Match[str], env: Mapping[str, str]) -> str:
    if m.group("escaped"):
        return "$"
    name = m.group("braced") or m.group("named")
    op, arg = m.group("op"), m.group("arg") or ""
    value = env.get(name)
    unset = value is None or (op is not None and op.startswith(":") and value == "")
    if op in (":-", "-") and unset:
        return arg
    if op in (":?", "?") and unset:
        raise ValueError(f"compose variable {name} is required: {arg}")
    return value or ""


def load_compose(path: Path, env: Mapping[str, str]) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path} must hold a mapping"
    return interpolate(data, env)


def environment_dict(environment: Any) -> dict[str, str]:
    """A compose or Kubernetes ``environment``/``env`` in either form, as a dict."""
    if environment is None:
        return {}
    if isinstance(environment, dict):
        return {k: "" if v is None else str(v) for k, v in environment.items()}
    out: dict[str, str] = {}
    for item in environment:
        name, _, value = str(item).partition("=")
        out[name] = value
    return out


# -- Dockerfile ------------------------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    base: str
    env: dict[str, str] = field(default_factory=dict)
    copies: list[tuple[list[str], str, str | None]] = field(default_factory=list)
    """(sources, destination, --from stage or None)"""
    runs: list[str] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    healthcheck: list[str] = field(default_factory=list)
    user: str | None = None
    exposed: list[str] = field(default_factory=list)
    stopsignal: str | None = None


class Dockerfile:
    """The instructions of a Dockerfile, per stage (enough of the syntax for ours)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stages: dict[str, Stage] = {}
        self.args: dict[str, str] = {}
        current: Stage | None = None
        for instruction, rest in _instructions(path.read_text()):
            if instruction == "FROM":
                words = rest.split()
                name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else words[0]
                current = Stage(name, _expand(words[0], self.args))
                self.stages[name] = current
            elif instruction == "ARG" and current is None:
                key, _, default = rest.partition("=")
                self.args[key.strip()] = default.strip()
            elif current is not None:
                _apply(current, instruction, rest)

    def stage(self, name: str) -> Stage:
        assert name in self.stages, f"{self.path} has no stage {name!r}: {list(self.stages)}"
        return self.stages[name]

    def default_target(self) -> Stage:
        """What `docker build` builds without --target: the last stage."""
        return list(self.stages.values())[-1]


def _instructions(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        instruction, _, rest = full.partition(" ")
        out.append((instruction.upper(), rest.strip()))
    return out


def _expand(text: str, variables: Mapping[str, str]) -> str:
    return re.sub(
        r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text
    )


def _exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return value


def _apply(stage: Stage, instruction: str, rest: str) -> None:
    if instruction == "ENV":
        for key, value in re.findall(r'(\w+)=("[^"]*"|\S+)', rest):
            stage.env[key] = _expand(value.strip('"'), stage.env)
    elif instruction == "COPY":
        words = rest.split()
        source_stage = next((w.split("=", 1)[1] for w in words if w.startswith("--from=")), None)
        paths = [w for w in words if not w.startswith("--")]
        stage.copies.append((paths[:-1], paths[-1], source_stage))
    elif instruction == "RUN":
        stage.runs.append(rest)
    elif instruction == "ENTRYPOINT":
        stage.entrypoint = _exec_form(rest)
    elif instruction == "CMD":
        stage.cmd = _exec_form(rest)
    elif instruction == "HEALTHCHECK":
        stage.healthcheck = _exec_form(rest[rest.index("CMD") + 3 :].strip())
    elif instruction == "USER":
        stage.user = rest
    elif instruction == "EXPOSE":
        stage.exposed += rest.split()
    elif instruction == "STOPSIGNAL":
        stage.stopsignal = rest


# -- the server's invocation -----------------------------------------------------------------------


@dataclass
class ServerInvocation:
    """How a deployment starts ``lmcache-svc``: what follows the program name, the
    container's environment, and which host file each mounted container file is."""

    where: str
    argv: list[str]
    env: dict[str, str]
    files: dict[str, Path] = field(default_factory=dict)


def parse_serve_args(argv: list[str], where: str) -> Any:
    """``argv`` through the real ``lmcache-svc`` parser; a bad flag fails naming ``where``."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = cli._parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"{where}: lmcache-svc rejects {argv}: {err.getvalue()}") from None
    assert args.command == "serve", f"{where}: runs `lmcache-svc {args.command}`, not serve"
    return args


def server_config(inv: ServerInvocation) -> Config:
    """The configuration the server in ``inv`` would start with (``load_config`` validates
    every key of the file, every ``LMCACHE_SVC_*`` variable and every flag)."""
    args = parse_serve_args(inv.argv, inv.where)
    path = args.config or inv.env.get("LMCACHE_SVC_CONFIG")
    host_file: Path | None = None
    if path is not None:
        assert path in inv.files, (
            f"{inv.where}: the config file {path} is neither mounted nor in the image "
            f"(known: {sorted(inv.files)})"
        )
        host_file = inv.files[path]
    try:
        return load_config(host_file, env=inv.env, overrides=cli._overrides(args))
    except Exception as e:
        raise AssertionError(f"{inv.where}: the server would not start: {e}") from None


# -- the engine's invocation -----------------------------------------------------------------------


API_SERVER = ["python", "-m", "vllm.entrypoints.openai.api_server"]


def engine_argv(entrypoint: list[str], args: list[str]) -> list[str]:
    """An engine's command (``vllm serve`` or the API server module) as vllm_args.py takes it."""
    if entrypoint == ["vllm", "serve"]:
        return ["serve", *args]
    assert entrypoint in (API_SERVER, ["python3", *API_SERVER[1:]]), f"not vLLM: {entrypoint}"
    return list(args)


def kv_transfer_json(argv: list[str], where: str) -> dict[str, Any]:
    """The ``--kv-transfer-config`` JSON of an engine command line."""
    for i, arg in enumerate(argv):
        if arg == "--kv-transfer-config":
            return dict(json.loads(argv[i + 1]))
        if arg.startswith("--kv-transfer-config="):
            return dict(json.loads(arg.split("=", 1)[1]))
    raise AssertionError(f"{where}: no --kv-transfer-config in {argv}")


def parse_engine_args(argvs: list[list[str]]) -> list[dict[str, Any]] | None:
    """vLLM's own parser's view of each argv (see vllm_args.py); None without .venv-vllm."""
    if not VLLM_PYTHON.exists():
        return None
    done = subprocess.run(
        [str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_args.py"))],
        input=json.dumps(argvs), capture_output=True, text=True, timeout=120,
        cwd="/", env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )  # fmt: skip
    assert done.returncode == 0, f"vllm_args.py failed:\n{done.stderr[-3000:]}"
    results: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def connector_config(kv: Mapping[str, Any], where: str) -> ConnectorConfig:
    """Check the connector is ours and its extra config passes the plugin's own parser."""
    assert kv.get("kv_connector") == CONNECTOR_CLASS, f"{where}: kv_connector {kv}"
    assert kv.get("kv_connector_module_path") == CONNECTOR_MODULE, f"{where}: module path"
    assert kv.get("kv_role") == "kv_both", f"{where}: kv_role {kv.get('kv_role')!r}"
    try:
        return parse_config(kv.get("kv_connector_extra_config"))
    except Exception as e:
        raise AssertionError(f"{where}: the plugin rejects its config: {e}") from None


def socket_of(url: str | None) -> str | None:
    """The socket path a connector ``url`` names, or None for host:port."""
    if url is None:
        return None
    path = url.removeprefix("unix:")
    return path if path.startswith("/") else None


def parse_size(text: str, flavor: str) -> int:
    """A size as ``flavor`` reads it: ``docker`` (``6g`` = 6 GiB), ``redis`` (``5gb`` = 5 GiB,
    ``5g`` = 5e9 bytes) or ``k8s`` (``12Gi`` = 12 GiB, ``12G`` = 12e9 bytes)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)(i?)(b?)", text.strip().lower())
    assert m, f"not a {flavor} size: {text!r}"
    number, unit, binary_i, suffix_b = m.groups()
    power = " kmgt".index(unit or " ")
    binary = {"docker": True, "redis": bool(suffix_b), "k8s": bool(binary_i)}[flavor]
    return int(float(number) * (1024 if binary else 1000) ** power)

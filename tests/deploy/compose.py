"""docker-compose.yml as its services will run: the server's and the engines' invocations.

The compose file is read with PyYAML and compose's variable interpolation (``manifests``);
an image's ENTRYPOINT, CMD, ENV and baked-in files come from the Dockerfile (``build.dockerfile``)
and stage (``build.target``, else its last) the service builds, so a service is checked as the
container would really start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from tests.deploy.manifests import (
    REPO,
    Dockerfile,
    ServerInvocation,
    engine_argv,
    environment_dict,
    load_compose,
)

COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
SERVER = "lmcache-svc"
PROFILES = ("gpu", "cpu")


@dataclass
class Mount:
    source: str  # a named volume, or a host path (resolved against the repository)
    target: str
    read_only: bool

    @property
    def is_bind(self) -> bool:
        return self.source.startswith((".", "/"))

    def host_path(self) -> Path:
        assert self.is_bind, f"{self.source} is a named volume"
        return (REPO / self.source).resolve()


@dataclass
class Port:
    host_ip: str
    host_port: int
    container_port: int


class Compose:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.data = load_compose(COMPOSE_FILE, env or {})
        self.services: dict[str, dict[str, Any]] = self.data["services"]
        self.dockerfile = Dockerfile(DOCKERFILE)

    def service(self, name: str) -> dict[str, Any]:
        assert name in self.services, f"docker-compose.yml has no service {name!r}"
        return self.services[name]

    def active(self, profile: str) -> list[str]:
        """Services `docker compose --profile <profile> up` starts."""
        return [n for n, s in self.services.items() if profile in s.get("profiles", [profile])]

    def engines(self, profile: str) -> list[str]:
        return [n for n in self.active(profile) if "--kv-transfer-config" in self.argv(n)]

    def all_engines(self) -> list[str]:
        return sorted({e for p in PROFILES for e in self.engines(p)})

    def engine_argv(self, name: str) -> list[str]:
        """The engine's command line as vLLM's parser sees it (see vllm_args.py)."""
        return engine_argv(self.entrypoint(name), self.argv(name))

    def engine_port(self, name: str) -> int:
        argv = self.argv(name)
        return int(argv[argv.index("--port") + 1])

    def mounts(self, name: str) -> list[Mount]:
        out = []
        for item in self.service(name).get("volumes", []):
            parts = str(item).split(":")
            read_only = len(parts) > 2 and "ro" in parts[2].split(",")
            out.append(Mount(parts[0], parts[1], read_only))
        return out

    def mount_at(self, name: str, container_path: str) -> Mount | None:
        """The mount that holds ``container_path`` in service ``name`` (deepest wins)."""
        best: Mount | None = None
        for m in self.mounts(name):
            target = PurePosixPath(m.target)
            path = PurePosixPath(container_path)
            if (path == target or target in path.parents) and (
                best is None or len(m.target) > len(best.target)
            ):
                best = m
        return best

    def ports(self, name: str) -> list[Port]:
        out = []
        for item in self.service(name).get("ports", []):
            text = str(item).split("/")[0]
            host_ip, host_port, container_port = text.rsplit(":", 2)
            out.append(Port(host_ip, int(host_port), int(container_port)))
        return out

    def env(self, name: str) -> dict[str, str]:
        """The container's environment: the image's ENV, then the service's environment."""
        stage = self._stage(name)
        return {
            **(stage.env if stage else {}),
            **environment_dict(self.service(name).get("environment")),
        }

    def entrypoint(self, name: str) -> list[str]:
        stage = self._stage(name)
        return list(self.service(name).get("entrypoint") or (stage.entrypoint if stage else []))

    def argv(self, name: str) -> list[str]:
        """What follows the entrypoint: the service's command, else the image's CMD."""
        stage = self._stage(name)
        command = self.service(name).get("command")
        if command is None:
            return list(stage.cmd) if stage else []
        assert isinstance(command, list), f"{name}: use the exec (list) form for command"
        return [str(c) for c in command]

    def server_invocation(self) -> ServerInvocation:
        entrypoint = self.entrypoint(SERVER)
        assert entrypoint == ["lmcache-svc"], f"{SERVER} runs {entrypoint}, not lmcache-svc"
        return ServerInvocation(
            f"docker-compose.yml service {SERVER}", self.argv(SERVER), self.env(SERVER),
            self.container_files(SERVER),
        )  # fmt: skip

    def container_files(self, name: str) -> dict[str, Path]:
        """Container path -> host file, for files baked into the image or bind-mounted."""
        files: dict[str, Path] = {}
        stage = self._stage(name)
        for sources, dest, from_stage in stage.copies if stage else []:
            if from_stage is None and len(sources) == 1 and (REPO / sources[0]).is_file():
                files[dest] = REPO / sources[0]
        for m in self.mounts(name):
            if not m.is_bind:
                continue
            host = m.host_path()
            if host.is_file():
                files[m.target] = host
            elif host.is_dir():
                for f in host.rglob("*"):
                    if f.is_file():
                        files[str(PurePosixPath(m.target) / f.relative_to(host).as_posix())] = f
        return files

    def image_stage(self, name: str) -> Any:
        """The Dockerfile stage service ``name`` builds (None for a pulled image)."""
        return self._stage(name)

    def _stage(self, name: str) -> Any:
        build = self.service(name).get("build")
        if not build:
            return None
        assert isinstance(build, dict) and build.get("context") == ".", f"{name}: {build}"
        dockerfile = Dockerfile(REPO / build.get("dockerfile", "Dockerfile"))
        target = build.get("target")
        return dockerfile.stage(target) if target else dockerfile.default_target()

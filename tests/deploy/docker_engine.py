"""A Docker engine for the container tests, and the commands run against it.

``engine()`` uses an engine that already answers ($DOCKER_HOST, the default socket, or the
project's private one) and otherwise starts the private one with scripts/docker/engine.sh
(its own socket, data root, exec root and bridge), which ``Engine.stop`` stops again: only
an engine started here is ever stopped. Every command runs with the engine's DOCKER_HOST
and Debian's docker CLI first on PATH (BuildKit is built into it; the other CLI on this
machine's PATH has no buildx), and is printed to the terminal with its time.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.manifests import REPO

ENGINE_SCRIPT = REPO / "scripts" / "docker" / "engine.sh"
STANDINS_SCRIPT = REPO / "scripts" / "docker" / "standins.sh"
DEBIAN_CLI_DIR = "/usr/bin"  # docker.io's CLI, the engine's own version

Say = Callable[[str], None]


def say_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class Engine:
    host: str  # DOCKER_HOST
    started_here: bool
    say: Say = say_to_stderr
    timings: dict[str, float] = field(default_factory=dict)
    docs_ran: list[str] = field(default_factory=list)  # docs/deploy.md commands run, as written

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_SVC_")}
        env["DOCKER_HOST"] = self.host
        env["PATH"] = f"{DEBIAN_CLI_DIR}:{env.get('PATH', '')}"
        env.setdefault("DOCKER_BUILDKIT", "1")
        env.update(extra or {})
        return env

    def run(
        self,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 600,
        check: bool = True,
        label: str | None = None,
        quiet: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """A shell command line (str) or an argv, in the repository, with the engine's env."""
        shell = isinstance(command, str)
        text = command if isinstance(command, str) else shlex.join(command)
        started = time.monotonic()
        done = subprocess.run(
            command, shell=shell, executable="/bin/bash" if shell else None, cwd=REPO,
            env=self.env(env), capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        elapsed = time.monotonic() - started
        if label:
            self.timings[label] = elapsed
        if not quiet:
            self.say(f"docker-stage: $ {text}  ({elapsed:.1f} s, exit {done.returncode})")
        if check and done.returncode != 0:
            raise AssertionError(
                f"{text} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
            )
        return done

    def docker(self, *args: str, check: bool = True, timeout_s: float = 120) -> str:
        done = self.run(["docker", *args], check=check, timeout_s=timeout_s, quiet=True)
        return done.stdout.strip()

    @property
    def private(self) -> bool:
        """The project's own engine (scripts/docker/engine.sh), whoever started it."""
        return self.host == private_host()

    def stop(self) -> None:
        if self.started_here:
            done = subprocess.run(
                [str(ENGINE_SCRIPT), "stop"], capture_output=True, text=True, timeout=180
            )
            self.say(f"docker-stage: {done.stderr.strip()}")


def _answers(host: str | None) -> bool:
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}
    if host:
        env["DOCKER_HOST"] = host
    docker = shutil.which("docker", path=f"{DEBIAN_CLI_DIR}:{env.get('PATH', '')}")
    if docker is None:
        return False
    try:
        done = subprocess.run(
            [docker, "version"], env=env, capture_output=True, timeout=15, check=False
        )
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def why_no_engine() -> str | None:
    """Why ``engine()`` cannot have an engine here, or None when it can."""
    if shutil.which("docker", path=f"{DEBIAN_CLI_DIR}:{os.environ.get('PATH', '')}") is None:
        return "no docker CLI (scripts/setup_ops.sh installs docker.io)"
    if os.geteuid() != 0 and not _answers(os.environ.get("DOCKER_HOST")):
        return "no Docker engine answers, and starting one (dockerd) needs root"
    return None


def private_host() -> str:
    done = subprocess.run([str(ENGINE_SCRIPT), "host"], capture_output=True, text=True, check=True)
    return done.stdout.strip().removeprefix("DOCKER_HOST=")


def engine(say: Say = say_to_stderr) -> Engine:
    for host in (os.environ.get("DOCKER_HOST"), None, private_host()):
        if _answers(host):
            name = host or "the default socket"
            say(f"docker-stage: using the Docker engine that answers at {name}")
            return Engine(host or "unix:///var/run/docker.sock", started_here=False, say=say)
    done = subprocess.run(
        [str(ENGINE_SCRIPT), "start"], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise AssertionError(f"scripts/docker/engine.sh start failed:\n{done.stderr}")
    say(f"docker-stage: {done.stderr.strip()}")
    return Engine(done.stdout.strip().removeprefix("DOCKER_HOST="), started_here=True, say=say)


def lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []

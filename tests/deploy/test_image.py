"""The Dockerfile without a Docker engine: its commands are the README's, its build context
(.dockerignore) holds what it copies, and the server image's install, command, healthcheck
and SIGTERM handling work when replayed here.

The replay builds a wheel from exactly the files the build stage copies, installs it
outside the source tree (as ``pip install '.[server]'`` does in the image, minus the
dependencies, which come from .venv), starts its ``lmcache-svc`` script with the image's
config file and ENTRYPOINT/CMD, asks the image's HEALTHCHECK, and stops it with SIGTERM.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest

from tests.deploy.manifests import REPO, Dockerfile, ServerInvocation, server_config

DOCKERFILE = Dockerfile(REPO / "Dockerfile")
VLLM = Dockerfile(REPO / "deploy" / "docker" / "vllm.Dockerfile")
VLLM_CPU = Dockerfile(REPO / "deploy" / "docker" / "vllm-cpu.Dockerfile")
ALL_DOCKERFILES = (DOCKERFILE, VLLM, VLLM_CPU)
HEALTHCHECK = REPO / "deploy" / "docker" / "healthcheck.py"
TOKEN = "t" * 32


# -- .dockerignore ---------------------------------------------------------------------------------


def dockerignore_patterns() -> list[tuple[bool, str]]:
    out = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append((line.startswith("!"), line.lstrip("!").strip("/")))
    return out


def _matches(pattern: str, path: str) -> bool:
    """Docker's rule: a pattern matches a path or any of its parent directories."""
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    if pattern.startswith("**/"):
        tail = pattern[3:]
        return any(fnmatch.fnmatchcase(p, tail) for p in parts)
    return any(fnmatch.fnmatchcase(c, pattern) for c in candidates)


def build_context() -> list[str]:
    """The files `docker build .` sends, per .dockerignore (the last matching pattern wins)."""
    patterns = dockerignore_patterns()
    negations = [pattern for negated, pattern in patterns if negated]

    def included(rel: str) -> bool:
        keep = True
        for negated, pattern in patterns:
            if _matches(pattern, rel):
                keep = negated
        return keep

    files = []
    for top, dirs, names in os.walk(REPO):
        rel_top = Path(top).relative_to(REPO).as_posix()
        prefix = "" if rel_top == "." else rel_top + "/"
        # Skip excluded directories nothing is re-included from (.git, the venvs).
        dirs[:] = [
            d for d in dirs
            if included(prefix + d) or any(n.startswith(prefix + d + "/") for n in negations)
        ]  # fmt: skip
        files += [prefix + n for n in names if included(prefix + n)]
    return sorted(files)


@pytest.fixture(scope="module")
def context() -> list[str]:
    return build_context()


def test_build_context_is_small_and_holds_every_copied_path(context: list[str]) -> None:
    assert not [f for f in context if f.startswith((".venv", ".git", "tests/"))]
    assert not [f for f in context if "__pycache__" in f or f.endswith(".pyc")]
    assert sum((REPO / f).stat().st_size for f in context) < 20 << 20
    for stage in (s for f in ALL_DOCKERFILES for s in f.stages.values()):
        for sources, _, from_stage in stage.copies:
            if from_stage is not None:
                continue
            for source in sources:
                inside = [f for f in context if f == source or f.startswith(source + "/")]
                assert inside, f"stage {stage.name} copies {source}, which is not in the context"


# -- the Dockerfile --------------------------------------------------------------------------------


def test_docker_build_builds_the_server_and_nothing_else() -> None:
    """The classic builder builds every stage before the target: the server's file holds
    only what the server needs, and each engine image has a file with one stage."""
    assert list(DOCKERFILE.stages) == ["build", "server"]
    assert DOCKERFILE.default_target().name == "server"
    assert len(VLLM.stages) == 1 and VLLM.default_target().base.startswith("vllm/vllm-openai:")
    assert len(VLLM_CPU.stages) == 1
    for dockerfile in ALL_DOCKERFILES:  # BuildKit would pull a frontend image for it
        assert "# syntax" not in dockerfile.path.read_text(), dockerfile.path


def test_server_image_runs_as_a_user_with_a_healthcheck_and_sigterm() -> None:
    server = DOCKERFILE.stage("server")
    assert server.user is not None and not server.user.startswith(("0", "root"))
    assert server.stopsignal == "SIGTERM"
    assert server.entrypoint == ["lmcache-svc"] and server.cmd == ["serve"]
    copied = {dest: sources for sources, dest, _ in server.copies}
    assert copied[server.healthcheck[-1]] == ["deploy/docker/healthcheck.py"]
    assert copied[server.env["LMCACHE_SVC_CONFIG"]] == ["deploy/lmcache-svc/config.yaml"]
    assert ["/opt/lmcache-svc"] in copied.values()  # the venv from the build stage, no more
    assert set(server.exposed) == {"8080", "50051"}


def test_install_commands_are_the_readmes() -> None:
    readme = (REPO / "README.md").read_text()
    (run,) = DOCKERFILE.stage("build").runs[-1:]
    assert run == "pip install '.[server]'" and run in readme
    assert "lmcache-svc serve" in readme
    cpu = " ".join(VLLM_CPU.default_target().runs)
    assert "bash scripts/setup_vllm.sh" in cpu  # the script CI runs for .venv-vllm
    script = (REPO / "scripts" / "setup_vllm.sh").read_text()
    sourced = re.findall(r'^source "\$root/(scripts/[^"]+)"', script, re.MULTILINE)
    assert sourced, "setup_vllm.sh no longer sources its shared steps?"
    copied = [src for sources, _, _ in VLLM_CPU.default_target().copies for src in sources]
    for path in sourced:  # the image must hold what the script sources
        assert any(path == c or path.startswith(c + "/") for c in copied), path
    steps = script + "".join((REPO / path).read_text() for path in sourced)
    assert "${VENV:-" in steps and "${PYTHON:-" in steps, "setup_vllm.sh options renamed?"
    gpu = " ".join(VLLM.default_target().runs)
    assert "/tmp/lmcache-svc /tmp/lmcache-svc/connectors/vllm" in gpu


def image_invocation(**env: str) -> ServerInvocation:
    server = DOCKERFILE.stage("server")
    files = {dest: REPO / sources[0] for sources, dest, src in server.copies if src is None}
    return ServerInvocation("the server image", server.cmd, {**server.env, **env}, files)


def test_image_config_refuses_the_network_without_a_token() -> None:
    with pytest.raises(AssertionError, match="reachable from other machines"):
        server_config(image_invocation())
    assert server_config(image_invocation(LMCACHE_SVC_AUTH_TOKEN=TOKEN)).auth_token == TOKEN
    opened = server_config(image_invocation(LMCACHE_SVC_ALLOW_UNAUTHENTICATED="true"))
    assert opened.host == "0.0.0.0" and opened.socket == Path("/run/lmcache-svc/grpc.sock")


# -- replay of the server image --------------------------------------------------------------------


@pytest.fixture(scope="module")
def installed(context: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The build stage's COPY set, built into a wheel and installed outside the tree."""
    root = tmp_path_factory.mktemp("image")
    src = root / "src"
    for sources, _, _ in DOCKERFILE.stage("build").copies:
        for source in sources:
            for f in context:
                if f == source or f.startswith(source + "/"):
                    target = src / f
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(REPO / f, target)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"), str(src)])
    (wheel,) = (root / "dist").glob("lmcache_svc-*.whl")
    run([*pip, "install", "--no-deps", "--target", str(root / "site"), str(wheel)])
    return root / "site"


def run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd="/")
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"


def image_env(site: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_SVC_")}
    env.update(DOCKERFILE.stage("server").env)
    env["PATH"] = f"{site / 'bin'}:{env['PATH']}"
    env["PYTHONPATH"] = str(site)  # before .venv's site-packages: the installed copy wins
    env["LMCACHE_SVC_CONFIG"] = str(REPO / "deploy" / "lmcache-svc" / "config.yaml")
    env.update(extra)
    return env


@pytest.fixture
def image_server(installed: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """The image's ENTRYPOINT + CMD from the installed wheel, with paths and ports that fit a
    test machine (loopback, free ports, a private socket) set the image's way: by env."""
    run_dir = tmp_path / "run"
    ready = run_dir / "ready.json"
    env = image_env(
        installed, LMCACHE_SVC_HOST="127.0.0.1", LMCACHE_SVC_HTTP_PORT="0",
        LMCACHE_SVC_GRPC_PORT="0", LMCACHE_SVC_SOCKET=str(run_dir / "grpc.sock"),
        LMCACHE_SVC_READY_FILE=str(ready), LMCACHE_SVC_CPU__CAPACITY="64MiB",
    )  # fmt: skip
    server = DOCKERFILE.stage("server")
    proc = subprocess.Popen(
        [*server.entrypoint, *server.cmd],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), f"not ready: {proc.poll()}"
        yield proc, ready
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        shm = json.loads(ready.read_text())["shm"] if ready.exists() else None
        if shm:
            Path("/dev/shm", shm).unlink(missing_ok=True)


def healthcheck(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    server = DOCKERFILE.stage("server")
    cmd = [sys.executable if server.healthcheck[0] == "python" else server.healthcheck[0],
           str(HEALTHCHECK), *args]  # fmt: skip
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=30, cwd="/", env=image_env(site)
    )


def test_installed_package_is_the_wheel_not_the_tree(installed: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import lmcache_svc.server.app as m; print(m.__file__)"],
        capture_output=True, text=True, timeout=60, cwd="/", env=image_env(installed),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(installed))
    assert (installed / "bin" / "lmcache-svc").exists()
    assert (installed / "lmcache_svc" / "v1" / "cache_pb2.py").exists()


def test_image_command_serves_answers_its_healthcheck_and_stops_on_sigterm(
    installed: Path, image_server: tuple[subprocess.Popen[bytes], Path], tmp_path: Path
) -> None:
    proc, ready_file = image_server
    ready = json.loads(ready_file.read_text())
    assert healthcheck(installed, str(ready_file)).returncode == 0
    grpc_only = tmp_path / "grpc-only.json"  # the fallback when REST is off
    grpc_only.write_text(json.dumps({"socket": ready["socket"]}))
    assert healthcheck(installed, str(grpc_only)).returncode == 0
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not Path(ready["socket"]).exists()
    assert not Path("/dev/shm", ready["shm"]).exists()
    stopped = healthcheck(installed, str(ready_file))
    assert stopped.returncode == 1 and "unhealthy" in stopped.stderr


def test_healthcheck_fails_before_the_server_is_ready(installed: Path, tmp_path: Path) -> None:
    missing = healthcheck(installed, str(tmp_path / "ready.json"))
    assert missing.returncode == 1 and "not ready" in missing.stderr


def test_config_errors_name_the_field() -> None:
    with pytest.raises(AssertionError, match="cpu.capacity"):
        server_config(
            image_invocation(LMCACHE_SVC_AUTH_TOKEN=TOKEN, LMCACHE_SVC_CPU__CAPACITY="lots")
        )

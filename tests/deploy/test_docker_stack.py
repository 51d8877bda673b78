"""The images built and the compose stack run for real, on a Docker engine.

A private engine is started when none answers (``docker_engine.py``; stopped afterwards).
Base images the registry cannot serve here are stand-ins built from Debian packages and
tagged with the real names (scripts/docker/standins.sh says which). The server image and the
CPU vLLM image are built from the project's Dockerfiles with the docs' commands (torch comes
from a local index: PyTorch's is unreachable here). Then the `cpu` profile runs with compose
v2 and checks, through published loopback ports only: the sidecar is healthy; a prompt sent
again after the vLLM container restarts is a sidecar hit with the same output; Redis holds
the written-through chunks; Prometheus has every target up and every dashboard query has
data; `stop` drains and exits 0; `down -v` leaves nothing. docker-compose 1.29 then runs the
same stack once more, briefly. Grafana is not run (no image, no Debian package), nor the
CUDA image (vLLM's image cannot be pulled, no GPU).
"""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from lmcache_svc_bench.procs import free_port
from tests.deploy import dashboard as dash
from tests.deploy import docker_stack as ds
from tests.deploy.deploy_doc import NOT_RUN, doc_commands, in_docs
from tests.deploy.docker_engine import STANDINS_SCRIPT, Engine, engine, why_no_engine
from tests.deploy.manifests import REPO
from tests.deploy.tiny_model import make_model, text_of

pytestmark = pytest.mark.timeout(3600)  # the first test builds the images (minutes, cold)

WHEEL_CACHE = Path("/var/cache/lmcache-svc-docker/wheels")
BASE_IMAGES = [
    "python:3.11-slim-bookworm", "redis:7.2-alpine", "oliver006/redis_exporter:v1.62.0",
    "prom/prometheus:v2.53.2",
]  # fmt: skip
SERVER_IMAGE = "lmcache-svc:0.1.0"
BUILT_IMAGES = (SERVER_IMAGE, "lmcache-svc-vllm-cpu:0.1.0")
CLASSIC_TAG = "lmcache-svc:classic-builder"
TORCH = "torch==2.13.0+cpu"
LOCAL_INDEX_PORT = 8765
LOCAL_INDEX = f"http://127.0.0.1:{LOCAL_INDEX_PORT}"  # as docs/deploy.md writes it
MIN_MARGIN = 0.0625  # tests/vllm/e2e.py: four bf16 steps of the tiny model's logprobs
CHUNK_TOKENS = 128  # the plugin's default chunk on the CPU backend
CHUNK_BYTES = CHUNK_TOKENS * 4 * 2 * 2 * 64 * 2  # tiny model: 4 layers, K+V, 2 heads x 64, bf16
RATE_WINDOW = "15m"  # longer than the whole stage: every rate sees its traffic
VLLM_START_S = 420.0


@pytest.fixture(scope="module")
def say(request: pytest.FixtureRequest) -> Any:
    """Lines for the terminal, past pytest's output capture: what the stage did and
    which images are stand-ins show in every run, not only in a failure's report."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def write(line: str) -> None:
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line(line)

    return write


@pytest.fixture(scope="module")
def docker(say: Any) -> Iterator[Engine]:
    reason = why_no_engine()
    if reason is not None:  # CI runs as root with setup_ops.sh's packages: never here
        pytest.fail(f"the container stage cannot run: {reason}")
    eng = engine(say)
    try:
        yield eng
    finally:
        eng.stop()


@pytest.fixture(scope="module")
def torch_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A PEP 503 index of the torch CPU wheel this machine's pip finds, on loopback (the
    build reaches it with --network host); the wheel is kept in WHEEL_CACHE."""
    root = tmp_path_factory.mktemp("torch-index")
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    wheels = list(WHEEL_CACHE.glob("torch-2.13.0+cpu-*.whl"))
    if not wheels:
        pip = [str(REPO / ".venv" / "bin" / "python"), "-m", "pip", "download", "-q", "--no-deps"]
        subprocess.run([*pip, "--only-binary=:all:", TORCH, "-d", str(WHEEL_CACHE)], check=True)
        wheels = list(WHEEL_CACHE.glob("torch-2.13.0+cpu-*.whl"))
    (root / "torch").mkdir()
    shutil.copy2(wheels[0], root / "torch" / wheels[0].name)
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    try:  # the docs' port: the URL is a build argument, so the same one keeps the layer cache
        server = http.server.ThreadingHTTPServer(("127.0.0.1", LOCAL_INDEX_PORT), handler)
    except OSError:  # taken: another port builds as well, without the cached layer
        server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def images(docker: Engine, torch_index: str, say: Any) -> dict[str, str]:
    """Stand-in bases where needed, then the server image (BuildKit and the classic
    builder) and the CPU vLLM image, with the docs' commands; image sizes by name."""
    before = {image: image_id(docker, image) for image in (*BUILT_IMAGES, CLASSIC_TAG)}
    done = docker.run([str(STANDINS_SCRIPT), *BASE_IMAGES], label="stand-ins", timeout_s=1800)
    for line in done.stderr.splitlines():
        say(f"docker-stage: {line}")
    server = in_docs("docker build -t lmcache-svc:0.1.0 .")
    docker.run(server, env={"DOCKER_BUILDKIT": "0"}, label="server (classic builder)")
    # A tag of its own keeps the classic build (and so its layer cache) past the prune below.
    docker.docker("tag", SERVER_IMAGE, CLASSIC_TAG)
    docker.run(server, label="server (BuildKit)")
    docker.docs_ran.append(server)
    cpu = in_docs(
        f"docker build --network host --build-arg TORCH_INDEX_URL={LOCAL_INDEX} "
        "-f deploy/docker/vllm-cpu.Dockerfile -t lmcache-svc-vllm-cpu:0.1.0 ."
    )
    say(f"docker-stage: torch from a local index at {torch_index} (PyTorch's is unreachable)")
    docker.run(cpu.replace(LOCAL_INDEX, torch_index), label="vllm-cpu", timeout_s=1800)
    docker.docs_ran.append(cpu)
    for image, old_id in before.items():  # earlier builds of these tags (gigabytes each)
        if old_id and old_id != image_id(docker, image):
            docker.docker("rmi", old_id, check=False)
    sizes = {}
    for image in (*BUILT_IMAGES, *BASE_IMAGES):
        size = int(docker.docker("image", "inspect", "-f", "{{.Size}}", image))
        sizes[image] = f"{size / 1e6:.0f} MB"
    say(f"docker-stage: build times (s): { {k: round(v) for k, v in docker.timings.items()} }")
    say(f"docker-stage: image sizes: {sizes}")
    return sizes


# -- the server image alone (docker run) ------------------------------------------------------


def image_id(docker: Engine, image: str) -> str:
    return docker.docker("image", "inspect", "-f", "{{.Id}}", image, check=False)


def test_docker_run_without_shm_size_says_so(docker: Engine, images: dict[str, str]) -> None:
    done = docker.run(
        "docker run --rm -e LMCACHE_SVC_AUTH_TOKEN=0123456789abcdef0123 lmcache-svc:0.1.0",
        check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "its size: 64 MiB" in done.stderr and "--shm-size" in done.stderr, done.stderr


def test_docker_run_from_the_docs_serves_and_stops_cleanly(
    docker: Engine, images: dict[str, str]
) -> None:
    token = "t" * 32
    port = free_port()
    run = in_docs(
        "docker run -d --name lmcache-svc --shm-size 2g -p 127.0.0.1:8080:8080 "
        '-e LMCACHE_SVC_AUTH_TOKEN="$LMCACHE_SVC_AUTH_TOKEN" lmcache-svc:0.1.0'
    )
    name = f"lmcache-svc-test-run-{port}"
    command = run.replace("--name lmcache-svc", f"--name {name}").replace(":8080:", f":{port}:")
    docker.run(command, env={"LMCACHE_SVC_AUTH_TOKEN": token})
    docker.docs_ran.append(run)
    try:
        deadline = time.monotonic() + 90
        while docker.docker("inspect", "-f", "{{.State.Health.Status}}", name) != "healthy":
            assert time.monotonic() < deadline, docker.docker("logs", name, check=False)
            time.sleep(1)
        url = f"http://127.0.0.1:{port}"
        assert ds.http(f"{url}/healthz")[0] == 200
        assert ds.http(f"{url}/v1/stats")[0] == 401  # the token is required
        request = ds.urllib.request.Request(
            f"{url}/v1/stats", headers={"Authorization": f"Bearer {token}"}
        )
        with ds.urllib.request.urlopen(request, timeout=10) as response:
            assert json.loads(response.read())["tiers"]
        docker.docker("stop", name, timeout_s=60)
        assert docker.docker("inspect", "-f", "{{.State.ExitCode}}", name) == "0"
    finally:
        docker.docker("rm", "-f", name, check=False)


# -- the compose stack, compose v2 ---------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = make_model(tmp_path_factory.mktemp("tiny-model") / "tiny")
    directory.chmod(0o755)
    for f in directory.iterdir():
        f.chmod(0o644)
    return directory


def bring_up(stack: ds.Stack) -> None:
    stack.compose_run("--profile cpu down -v --remove-orphans")  # what a killed run left
    stack.doc(in_docs("docker compose --profile cpu up -d"))
    stack.wait_healthy("lmcache-svc")


@pytest.fixture(scope="module")
def stack(docker: Engine, images: dict[str, str], model_dir: Path) -> Iterator[ds.Stack]:
    s = ds.Stack(docker, "docker compose", model_dir)
    try:
        bring_up(s)
        yield s
    finally:
        s.compose_run("--profile cpu down -v --remove-orphans", check=False)


def complete(stack: ds.Stack, prompt: str, max_tokens: int = 8) -> dict[str, Any]:
    status, body = ds.http(f"{stack.url('ENGINE_PORT')}/v1/completions", {
        "model": ds.MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": 2,
    }, timeout_s=300)  # fmt: skip
    assert status == 200, f"{status}: {body[:500]!r}\n{stack.logs(ds.ENGINE)}"
    choice: dict[str, Any] = json.loads(body)["choices"][0]
    return choice


def min_margin(choice: dict[str, Any]) -> float:
    margins = []
    for top in choice["logprobs"]["top_logprobs"]:
        best = sorted(top.values(), reverse=True)
        margins.append(best[0] - best[1] if len(best) > 1 else float("inf"))
    return min(margins)


def wait_engine(stack: ds.Stack) -> float:
    """Until vLLM answers and Prometheus has scraped the new process once (so the requests
    that follow are increases rate() can see); returns when it answered."""
    stack.wait_http("ENGINE_PORT", "/health", VLLM_START_S, ds.ENGINE)
    answered = time.time()
    stack.wait_scraped("vllm", answered)
    return answered


def test_sidecar_is_healthy(stack: ds.Stack) -> None:
    assert stack.inspect("lmcache-svc")["State"]["Health"]["Status"] == "healthy"
    assert ds.http(stack.url("HTTP_PORT") + "/healthz")[0] == 200
    stats = json.loads(stack.doc(in_docs("curl -s 127.0.0.1:8080/v1/stats")))
    assert stats["tiers"]


def test_a_prompt_after_a_vllm_restart_is_a_sidecar_hit(stack: ds.Stack) -> None:
    wait_engine(stack)
    stack.doc(in_docs(
        "curl -s 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d "
        "'{\"model\": \"Qwen/Qwen2.5-0.5B-Instruct\", \"prompt\": \"...a long shared "
        "prefix...\", \"max_tokens\": 16}'"
    ))  # fmt: skip
    # A prompt whose greedy tokens are no near-ties (tests/vllm/e2e.py says why).
    for seed in range(3, 3 + 30):
        prompt = text_of([3 + (seed * 7919 + i * 104729) % 1021 for i in range(300)])
        first = complete(stack, prompt)
        if min_margin(first) >= MIN_MARGIN:
            break
    else:
        raise AssertionError(f"no prompt with margins >= {MIN_MARGIN} in 30 draws")
    read_before = ds.metric_sum(stack.metrics("HTTP_PORT"), "lmcache_svc_read_bytes_total")
    stack.compose_run(f"restart {ds.ENGINE}")
    wait_engine(stack)
    second = complete(stack, prompt)
    vllm = stack.metrics("ENGINE_PORT")
    hits = ds.metric_sum(vllm, "vllm:external_prefix_cache_hits_total")
    read_after = ds.metric_sum(stack.metrics("HTTP_PORT"), "lmcache_svc_read_bytes_total")
    assert hits >= 2 * CHUNK_TOKENS, f"vLLM loaded {hits} tokens from the sidecar"
    assert read_after - read_before >= 2 * CHUNK_BYTES, (read_before, read_after)
    assert second["text"] == first["text"]
    assert second["logprobs"]["tokens"] == first["logprobs"]["tokens"]
    stack.hit_checked = True


def test_redis_holds_the_written_through_chunks(stack: ds.Stack) -> None:
    assert stack.hit_checked, "runs after the hit test"
    deadline = time.monotonic() + 60
    while True:
        redis = stack.tier("redis")
        keys = stack.query('sum(redis_db_keys{db="db0"})')
        if redis["num_chunks"] >= 2 and keys and keys[0] >= redis["num_chunks"]:
            break
        assert time.monotonic() < deadline, (redis, keys)
        time.sleep(2)
    out = stack.doc(in_docs(
        "docker compose exec -T lmcache-svc lmcache-svc stats --url /run/lmcache-svc/grpc.sock"
    ))  # fmt: skip
    assert "redis" in out


def test_prometheus_has_every_target_up(stack: ds.Stack) -> None:
    deadline = time.monotonic() + 60
    while True:
        targets = stack.prometheus("/api/v1/targets")["data"]["activeTargets"]
        health = {t["labels"]["job"]: t["health"] for t in targets}
        if len(health) == 3 and set(health.values()) == {"up"}:
            return
        assert time.monotonic() < deadline, health
        time.sleep(2)


def test_every_dashboard_query_returns_data(stack: ds.Stack) -> None:
    """After the vLLM traffic above, the cache traffic vLLM does not cause (evictions,
    lower tiers, expiries, errors, a Redis outage), through the published ports."""
    # New prompts, so the running engine saves chunks after Prometheus scraped it: the hit
    # test's last prompt only loaded, and the plugin's save-latency panel once had no data.
    for seed in range(2):
        complete(stack, text_of([5 + (seed * 104729 + i * 7919) % 1021 for i in range(300)]))
    ds.drive_cache(stack)
    ds.redis_outage(stack)
    queries = dash.queries(dash.load())
    deadline = time.monotonic() + 60
    while True:
        missing = [q for q in queries if not stack.query(q.promql(RATE_WINDOW))]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(5)
    assert not missing, "no data for:\n" + "\n".join(
        f"  {q.panel} [{q.ref_id}]: {q.promql(RATE_WINDOW)}" for q in missing
    )


def test_stop_drains_and_exits_0_and_down_leaves_nothing(stack: ds.Stack) -> None:
    ids = {service: stack.container(service) for service in ds.SERVICES}
    data_root = stack.engine.docker("info", "-f", "{{.DockerRootDir}}")
    stack.doc(in_docs("docker compose --profile cpu stop"))
    for service in ("lmcache-svc", ds.ENGINE):
        state = stack.inspect(service)["State"]
        assert state["ExitCode"] == 0, (service, state, stack.logs(service))
    assert "draining" in stack.logs("lmcache-svc")
    stack.doc(in_docs("docker compose --profile cpu down -v"))
    assert_nothing_left(stack, ids, data_root)


def assert_nothing_left(stack: ds.Stack, ids: dict[str, str], data_root: str) -> None:
    label = f"label=com.docker.compose.project={ds.PROJECT}"
    for kind in ("container", "volume", "network"):
        left = stack.engine.docker(kind, "ls", "-q", *(["-a"] if kind == "container" else []),
                                   "--filter", label)  # fmt: skip
        assert not left, f"{kind}s left: {left}"
    mounts = Path("/proc/mounts").read_text()
    for cid in ids.values():  # each container's /dev/shm (the arena lived in one) is gone
        assert f"{data_root}/containers/{cid}" not in mounts, cid


# -- the same stack with docker-compose 1.29 -----------------------------------------------------


def test_docker_compose_1_29_runs_the_same_stack(
    docker: Engine, stack: ds.Stack, model_dir: Path
) -> None:
    assert stack.hit_checked, "runs after the v2 stack is down"
    version = docker.run("docker-compose version --short", quiet=True).stdout.strip()
    assert version.startswith("1.29"), version
    old = ds.Stack(docker, "docker-compose", model_dir)
    try:
        bring_up(old)
        wait_engine(old)
        prompt = text_of([5 + i % 1000 for i in range(300)])
        assert complete(old, prompt)["text"] == complete(old, prompt)["text"]
        assert old.tier("cpu")["num_chunks"] >= 2
        ids = {service: old.container(service) for service in ds.SERVICES}
        data_root = docker.docker("info", "-f", "{{.DockerRootDir}}")
        old.doc("docker compose --profile cpu stop")
        assert old.inspect("lmcache-svc")["State"]["ExitCode"] == 0
        old.doc("docker compose --profile cpu down -v")
        assert_nothing_left(old, ids, data_root)
    finally:
        old.compose_run("--profile cpu down -v --remove-orphans", check=False)


# -- the docs' commands ------------------------------------------------------------------------


def test_every_docs_command_is_run_or_listed_with_a_reason(stack: ds.Stack) -> None:
    """Runs last: each command of docs/deploy.md was run above or is in NOT_RUN."""
    ran = set(stack.engine.docs_ran) | set(NOT_RUN)
    missing = [c for c in doc_commands() if c not in ran]
    assert not missing, f"docs/deploy.md commands no test runs: {missing}"


def test_commands_not_run_are_in_the_docs() -> None:
    """No engine needed: each NOT_RUN entry is a command docs/deploy.md still has."""
    assert set(NOT_RUN) <= set(doc_commands()), set(NOT_RUN) - set(doc_commands())

"""The compose stack as the container tests run it: the project's docker-compose.yml (plus
compose.tiny-model.yml, which mounts the test's tiny model), the `cpu` profile, a project
name of its own, free loopback ports, and small sizes. Everything is checked through the
published loopback ports; ``docker`` is used only to run the stack and read its state.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcache_svc.bench.procs import free_port
from lmcache_svc.client import CacheClient
from lmcache_svc.errors import LMCacheSvcError
from lmcache_svc.keys import KVLayout, Namespace, chunk_hashes
from tests.deploy.docker_engine import Engine
from tests.helpers import make_chunk

PROJECT = "lmcache-svc-test"
COMPOSE_FILES = "docker-compose.yml:tests/deploy/compose.tiny-model.yml"
# Grafana has no Debian package and its image cannot be pulled here: every other service.
SERVICES = ["lmcache-svc", "vllm-cpu", "redis", "redis-exporter", "prometheus"]
ENGINE = "vllm-cpu"
MODEL = "/models/tiny"
# Small enough for a shared 2-core, 24 GiB machine; SHM_SIZE >= ARENA_SIZE + vLLM's share.
SIZES = {
    "ARENA_SIZE": "16MiB",
    "SHM_SIZE": "1g",
    "SSD_SIZE": "8MiB",
    "REDIS_CAPACITY": "256MiB",
    "REDIS_MAXMEMORY": "320mb",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
PORTS = {"HTTP_PORT": 8080, "GRPC_PORT": 50051, "ENGINE_PORT": 8000, "PROMETHEUS_PORT": 9090}


def http(
    url: str,
    body: dict[str, Any] | None = None,
    timeout_s: float = 30.0,
    method: str | None = None,
    raw: bytes | None = None,
) -> tuple[int, bytes]:
    data = raw if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (text format)."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


@dataclass
class Stack:
    engine: Engine
    compose: str  # "docker compose" (v2) or "docker-compose" (1.29)
    model_dir: Path
    ports: dict[str, int] = field(default_factory=dict)
    hit_checked: bool = False

    def __post_init__(self) -> None:
        self.ports = {name: free_port() for name in PORTS}

    @property
    def env(self) -> dict[str, str]:
        return {
            "COMPOSE_PROJECT_NAME": PROJECT, "COMPOSE_FILE": COMPOSE_FILES,
            "TINY_MODEL_DIR": str(self.model_dir), "CPU_MODEL": MODEL,
            "GRAFANA_PORT": str(free_port()), **SIZES,
            **{name: str(port) for name, port in self.ports.items()},
        }  # fmt: skip

    def url(self, port: str) -> str:
        return f"http://127.0.0.1:{self.ports[port]}"

    def compose_run(self, args: str, timeout_s: float = 600, check: bool = True) -> str:
        done = self.engine.run(
            f"{self.compose} {args}", env=self.env, timeout_s=timeout_s, check=check
        )
        return done.stdout + done.stderr

    def doc(self, command: str, timeout_s: float = 600) -> str:
        """Run a command as docs/deploy.md writes it, on this stack: this compose
        implementation, the test's ports, model and prompt (``localize``)."""
        self.engine.docs_ran.append(command)
        done = self.engine.run(localize(command, self), env=self.env, timeout_s=timeout_s)
        return done.stdout

    def container(self, service: str) -> str:
        cid = self.engine.run(
            f"{self.compose} ps -a -q {service}", env=self.env, quiet=True
        ).stdout.strip()  # fmt: skip
        assert cid, f"no container for {service}"
        return cid

    def inspect(self, service: str) -> dict[str, Any]:
        data: list[dict[str, Any]] = json.loads(
            self.engine.docker("inspect", self.container(service))
        )  # fmt: skip
        return data[0]

    def logs(self, service: str) -> str:
        return self.compose_run(f"logs --no-color --tail 60 {service}", check=False)

    def wait_healthy(self, service: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while (health := self.inspect(service)["State"].get("Health", {}).get("Status")) != (
            "healthy"
        ):
            assert time.monotonic() < deadline, f"{service} is {health}:\n{self.logs(service)}"
            time.sleep(1)

    def wait_http(self, port: str, path: str, timeout_s: float, service: str) -> None:
        deadline = time.monotonic() + timeout_s
        while http(self.url(port) + path, timeout_s=5)[0] != 200:
            state = self.inspect(service)["State"]
            assert state["Status"] == "running" and time.monotonic() < deadline, (
                f"{service} never answered {path} ({state['Status']}, "
                f"restarts: {state.get('RestartCount')}):\n{self.logs(service)}"
            )
            time.sleep(1)

    def tier(self, name: str) -> dict[str, Any]:
        """One tier of the sidecar's GET /v1/stats (capacity_bytes, used_bytes, num_chunks)."""
        status, body = http(self.url("HTTP_PORT") + "/v1/stats")
        assert status == 200, (status, body[:300])
        tiers: list[dict[str, Any]] = json.loads(body)["tiers"]
        found = [t for t in tiers if t["name"] == name]
        assert found, f"no tier {name} in {tiers}"
        return found[0]

    def metrics(self, port: str) -> str:
        status, body = http(self.url(port) + "/metrics")
        assert status == 200, (port, status, body[:300])
        return body.decode()

    def prometheus(self, path: str, **params: str) -> dict[str, Any]:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        status, body = http(f"{self.url('PROMETHEUS_PORT')}{path}{query}")
        assert status == 200, (path, status, body[:300])
        answer: dict[str, Any] = json.loads(body)
        return answer

    def query(self, promql: str) -> list[float]:
        """Finite values of ``promql`` now."""
        answer = self.prometheus("/api/v1/query", query=promql)
        values = [float(r["value"][1]) for r in answer["data"]["result"]]
        return [v for v in values if v == v and abs(v) != float("inf")]

    def wait_scraped(self, job: str, after: float, timeout_s: float = 60) -> None:
        """Until Prometheus scraped ``job`` (up == 1) later than ``after`` (Unix time)."""
        deadline = time.monotonic() + timeout_s
        # timestamp() of a selector, not of an expression (that is the evaluation time)
        while not (
            self.query(f'timestamp(up{{job="{job}"}}) > {after}')
            and self.query(f'up{{job="{job}"}} == 1')
        ):
            assert time.monotonic() < deadline, f"Prometheus did not scrape {job} after {after}"
            time.sleep(1)


# Default ports as the docs write them -> the variables the test sets.
DOC_PORTS = {"8080": "HTTP_PORT", "8000": "ENGINE_PORT", "9090": "PROMETHEUS_PORT"}
DOC_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
DOC_PROMPT = "...a long shared prefix..."
DOC_PROMPT_WORDS = " ".join(f"w{3 + i}" for i in range(300))  # 2 chunks and a tail


def localize(command: str, stack: Stack) -> str:
    """A docs command on the test's stack: which compose, which services (no Grafana: no
    image), ports, model and prompt. Nothing else changes."""
    out = command
    if stack.compose != "docker compose":
        out = out.replace("docker compose ", f"{stack.compose} ")
    if re.search(r" up -d$", out):
        out += " " + " ".join(SERVICES)
    for port, name in DOC_PORTS.items():
        out = out.replace(f"127.0.0.1:{port}", f"127.0.0.1:{stack.ports[name]}")
    return out.replace(DOC_MODEL, MODEL).replace(DOC_PROMPT, DOC_PROMPT_WORDS)


# -- traffic for the dashboard: what vLLM alone does not cause ------------------------------------

# 512 KiB chunks (test_dashboard.py's): 48 of them overflow the 16 MiB arena into the 8 MiB
# SSD tier and past it, so the first ones stay only in Redis.
CACHE_LAYOUT = KVLayout(
    "uint8", num_layers=1, num_kv_heads=1, head_size=1024, block_size=16, page_layout="test"
)
CACHE_NS = Namespace(model="docker-stack", layout=CACHE_LAYOUT, chunk_size=256)
NUM_CHUNKS = 48


def drive_cache(stack: Stack) -> None:
    """Through the published gRPC and REST ports: evictions, demotions, promotions, reads
    from every tier, misses, an abandoned reservation that expires, bad requests."""
    size = CACHE_NS.chunk_bytes
    hashes = chunk_hashes(CACHE_NS, list(range(NUM_CHUNKS * CACHE_NS.chunk_size)))
    with CacheClient(f"127.0.0.1:{stack.ports['GRPC_PORT']}", use_shm=False, timeout_s=30) as c:
        ns_id = c.register_namespace(CACHE_NS)
        # The first Get makes its latency series; rate() counts only what follows a scrape.
        c.put(ns_id, [(hashes[0], make_chunk(0, size))])
        assert c.get(ns_id, hashes[:1]) == [make_chunk(0, size)]
        stack.wait_scraped("lmcache-svc", time.time())
        for i in range(0, NUM_CHUNKS, 8):
            c.put(ns_id, [(h, make_chunk(i + j, size)) for j, h in enumerate(hashes[i : i + 8])])
        found = c.lookup(ns_id, hashes)
        assert {"cpu", "ssd", "redis"} <= set(found.tiers), found.tiers
        for i in (0, 1, NUM_CHUNKS // 2):  # from Redis, from the SSD: promoted into the arena
            assert c.get(ns_id, [hashes[i]]) == [make_chunk(i, size)]
        unknown = chunk_hashes(CACHE_NS, [7] * (2 * CACHE_NS.chunk_size))
        assert c.lookup(ns_id, unknown).num_hit_chunks == 0
        try:  # reserved, then left: this client cannot map the segment (another "host")
            c.prepare_store(ns_id, unknown[:1], ttl_s=0.2)
        except LMCacheSvcError:
            pass
    bad = f"{stack.url('HTTP_PORT')}/v1/chunks/{CACHE_NS.namespace_id.hex()}/{hashes[0].hex()}"
    assert http(bad, method="PUT", raw=b"short")[0] == 400  # size_mismatch


def redis_outage(stack: Stack) -> None:
    """Redis paused while a chunk is written through: tier_unavailable, then recovery."""
    extra = chunk_hashes(CACHE_NS, [11] * CACHE_NS.chunk_size)
    stack.compose_run("pause redis")
    try:
        with CacheClient(f"127.0.0.1:{stack.ports['GRPC_PORT']}", use_shm=False) as c:
            chunk = make_chunk(99, CACHE_NS.chunk_bytes)
            c.put(c.register_namespace(CACHE_NS), [(extra[0], chunk)])
        wait_metric(stack, 'lmcache_svc_errors_total{kind="tier_unavailable"}', 30)
    finally:
        stack.compose_run("unpause redis")
    wait_metric(stack, 'lmcache_svc_tier_breaker_state{tier="redis"} 0.0', 90)


def wait_metric(stack: Stack, sample: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while sample not in stack.metrics("HTTP_PORT"):
        assert time.monotonic() < deadline, f"the server never showed {sample}"
        time.sleep(0.5)

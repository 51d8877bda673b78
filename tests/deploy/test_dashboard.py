"""The Grafana dashboard against real metrics.

Static checks: the JSON is a well-formed dashboard, every variable is defined, every metric
it names is documented (docs/metrics.md), exported by the plugin or by vLLM, and every panel
is described in docs/deploy.md.

Live check: a real lmcache-svc (tiny arena, an SSD tier and a Redis tier), a real
redis-server with redis_exporter, and a real CPU vLLM (tiny random model, the plugin
talking to the same server) are scraped every second by a real Prometheus (Debian's
package). Traffic goes through the server (stores past the arena's capacity, lookups with
hits and misses, loads from lower tiers, an abandoned reservation, a held lease, bad
requests) and through vLLM (a miss, a local prefix hit, an external hit from lmcache-svc).
Then every PromQL expression of the dashboard is evaluated through /api/v1/query and must
return at least one finite sample; every alert rule must evaluate without error.
"""

from __future__ import annotations

import math
import re
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from lmcache_svc.client import CacheClient
from lmcache_svc.keys import KVLayout, Namespace, chunk_hashes
from lmcache_svc_bench.procs import ServerProc, start_server
from lmcache_svc_bench.redis_procs import RedisProc, send_command
from tests.deploy import dashboard as dash
from tests.deploy import stack
from tests.deploy.manifests import REPO
from tests.helpers import make_chunk

METRICS_DOC = REPO / "docs" / "metrics.md"
DEPLOY_DOC = REPO / "docs" / "deploy.md"
PLUGIN_PROM = REPO / "connectors" / "vllm" / "lmcache_svc_vllm" / "prom.py"
RATE_WINDOW = "2m"  # covers the whole test: every rate sees its traffic
VLLM_STARTUP_S = 150.0
DATA_TIMEOUT_S = 45.0


@pytest.fixture(scope="module")
def board() -> dict[str, Any]:
    return dash.load()


# -- static checks ---------------------------------------------------------------------------------


def test_dashboard_is_well_formed(board: dict[str, Any]) -> None:
    assert board["uid"] == "lmcache-svc" and board["title"]
    ids = [p["id"] for p in dash.panels(board)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    taken: set[tuple[int, int]] = set()
    for p in dash.panels(board):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        cells = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & taken, f"panel {p['title']!r} overlaps another"
        taken |= cells
        if p["type"] == "row":
            continue
        assert p.get("description"), f"panel {p['title']!r} has no description"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]


def test_every_variable_is_defined(board: dict[str, Any]) -> None:
    defined = set(dash.variables(board)) | dash.GRAFANA_BUILTINS
    for q in dash.queries(board):
        assert dash.used_variables(q.expr) <= defined, f"{q.panel}: {q.expr}"
        if "$__rate_interval" not in q.expr:
            assert "rate(" not in q.expr, f"{q.panel}: use $__rate_interval in rate()"


def vllm_source_metric_names() -> set[str] | None:
    """Metric names vLLM registers ('vllm:...'), read from the installed package's source."""
    if stack.vllm_available() is not None:
        return None
    (site,) = (REPO / ".venv-vllm" / "lib").glob("python3*/site-packages")
    names: set[str] = set()
    for source in (site / "vllm" / "v1" / "metrics").rglob("*.py"):
        names |= set(re.findall(r'"(vllm:[a-z_]+)"', source.read_text()))
    return names


def base_name(metric: str) -> str:
    return re.sub(r"_(total|bucket|count|sum)$", "", metric)


def test_every_metric_is_documented_or_exported(board: dict[str, Any]) -> None:
    documented = set(re.findall(r"`(lmcache_svc_\w+)`", METRICS_DOC.read_text()))
    plugin = {
        f"vllm:lmcache_svc_{n}"
        for n in re.findall(r'^    "(\w+)": "', PLUGIN_PROM.read_text(), re.MULTILINE)
    }
    vllm = vllm_source_metric_names()
    for q in dash.queries(board):
        for metric in q.metric_names():
            if metric.startswith("lmcache_svc_"):
                assert metric in documented or base_name(metric) in documented, (
                    f"{q.panel}: {metric} is not in docs/metrics.md"
                )
            elif metric.startswith("vllm:lmcache_svc_"):
                assert base_name(metric) in plugin, f"{q.panel}: the plugin has no {metric}"
            elif metric.startswith("vllm:"):
                if vllm is not None:
                    assert base_name(metric) in vllm, f"{q.panel}: vLLM has no {metric}"
            else:
                assert metric.startswith("redis_"), f"{q.panel}: whose metric is {metric}?"


def test_every_panel_is_described_in_the_docs(board: dict[str, Any]) -> None:
    text = DEPLOY_DOC.read_text()
    for p in dash.panels(board):
        mark = f"### {p['title']}\n" if p["type"] == "row" else f"**{p['title']}**"
        assert mark in text, f"docs/deploy.md does not describe {p['title']!r}"


# -- the live stack --------------------------------------------------------------------------------

# 512 KiB chunks, the size of the tiny vLLM model's chunks: one size class in the arena, so
# the test's chunks and vLLM's compete for the same slots (as one model's engines do).
LAYOUT = KVLayout(
    "uint8", num_layers=1, num_kv_heads=1, head_size=1024, block_size=16, page_layout="test"
)
NS = Namespace(model="dashboard", layout=LAYOUT, chunk_size=256)
CHUNK = NS.chunk_bytes
NUM_CHUNKS = 24  # 12 MiB: through a 4 MiB arena and a 2 MiB SSD tier into Redis
VLLM_PROMPT = list(range(5, 5 + 600))  # two full 256-token chunks for the plugin


@dataclass
class Stack:
    server: ServerProc
    prometheus: stack.Proc
    vllm: stack.Proc | None
    vllm_skip_reason: str | None
    model_dir: Path


def require_binaries() -> None:
    for binary in (stack.PROMETHEUS, stack.REDIS_EXPORTER):
        if shutil.which(binary) is None:
            pytest.skip(f"{binary} is not on PATH (scripts/setup_ops.sh installs it)")


@pytest.fixture(scope="module")
def live(redis_server: RedisProc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require_binaries()
    workdir = tmp_path_factory.mktemp("dashboard")
    started: list[stack.Proc] = []
    server = start_server(
        workdir, "--cpu-bytes", "4MiB", "--ssd-path", str(workdir / "ssd"), "--ssd-bytes", "2MiB",
        "--redis-url", redis_server.url, "--redis-bytes", "64MiB",
        env={"LMCACHE_SVC_REDIS__KEY_PREFIX": f"dashboard-{time.monotonic_ns()}:",
             "LMCACHE_SVC_REDIS__TIMEOUT_S": "0.5"},
    )  # fmt: skip
    try:
        skip_reason = stack.vllm_available()
        model_dir = workdir / "model"
        vllm = None
        if skip_reason is None:  # the slowest start first; it comes up while traffic runs
            from lmcache_svc_bench.vllm.bench_model import make_tiny_model

            make_tiny_model(model_dir)
            vllm = stack.start_vllm(workdir, model_dir, server.socket)
            started.append(vllm)
        exporter = stack.start_redis_exporter(workdir, redis_server.url)
        started.append(exporter)
        targets = {
            "lmcache-svc": server.http_url.removeprefix("http://"),
            "redis": exporter.url.removeprefix("http://"),
        }
        if vllm is not None:
            targets["vllm"] = vllm.url.removeprefix("http://")
        prometheus = stack.start_prometheus(workdir, targets)
        started.append(prometheus)
        yield Stack(server, prometheus, vllm, skip_reason, model_dir)
    finally:
        for proc in reversed(started):
            proc.stop()
        server.cleanup()


def wait_for(prometheus: stack.Proc, promql: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if finite_values(stack.query(prometheus, promql)):
            return
        time.sleep(0.25)
    raise AssertionError(f"Prometheus never saw {promql}")


def finite_values(answer: dict[str, Any]) -> list[float]:
    if answer.get("status") != "success":
        return []
    values = [float(r["value"][1]) for r in answer["data"]["result"]]
    return [v for v in values if math.isfinite(v)]


def scraped_twice(prometheus: stack.Proc, job: str) -> None:
    """Wait until ``job`` has been scraped twice more, so the series that exist now have a
    sample before the traffic that follows (rate() only counts increases it sees)."""
    wait_for(prometheus, f'up{{job="{job}"}} == 1', 30)
    first = time.time()
    wait_for(prometheus, f'timestamp(up{{job="{job}"}}) > {first + 1}', 10)


def warm_up(client: CacheClient, ns_id: bytes, hashes: Sequence[bytes]) -> None:
    """One call of each kind, so every series exists before the traffic Prometheus must see
    increase (a series' first sample already holds what happened before it)."""
    client.store(ns_id, hashes[:1], [make_chunk(0, CHUNK)])
    client.lookup(ns_id, hashes[:2])
    client.release_load(client.prepare_load(ns_id, hashes[:1]))
    client.get(ns_id, hashes[:1])
    client.put(ns_id, [(hashes[1], make_chunk(1, CHUNK))])


def wait_for_metric(server: ServerProc, sample: str, timeout_s: float = 10.0) -> None:
    """Until the server's /metrics has ``sample`` (write-through fails in the background)."""
    deadline = time.monotonic() + timeout_s
    while sample not in httpx.get(f"{server.http_url}/metrics", timeout=5).text:
        assert time.monotonic() < deadline, f"the server never counted {sample}"
        time.sleep(0.1)


def drive_server(server: ServerProc, redis: RedisProc) -> None:
    """Every kind of traffic the dashboard shows, through the real server."""
    hashes = chunk_hashes(NS, list(range(NUM_CHUNKS * NS.chunk_size)))
    with CacheClient(server.socket, timeout_s=10) as client:
        ns_id = client.register_namespace(NS)
        for i, h in enumerate(hashes[2:], start=2):  # evictions, demotions, write-through
            assert client.store(ns_id, [h], [make_chunk(i, CHUNK)]) == 1
        unknown = chunk_hashes(NS, [7] * (4 * NS.chunk_size))
        for _ in range(3):  # hits in every tier, and misses
            found = client.lookup(ns_id, hashes)
            assert {"cpu", "ssd", "redis"} <= set(found.tiers), found.tiers
            assert client.lookup(ns_id, unknown).num_hit_chunks == 0
        for i in range(2, 6):  # promotions from the lower tiers, and inline reads
            assert client.load(ns_id, [hashes[i]]) == [make_chunk(i, CHUNK)]
            assert client.get(ns_id, [hashes[-i]]) == [make_chunk(NUM_CHUNKS - i, CHUNK)]
        # Redis stops answering writes for longer than the tier's timeout: the write-through
        # of the next chunks fails (tier_unavailable), and the server goes on without it.
        assert send_command(redis.port, "CLIENT", "PAUSE", "10000", "WRITE").startswith(b"+OK")
        try:
            extra = chunk_hashes(NS, [11] * (3 * NS.chunk_size))
            assert client.store(ns_id, extra, [make_chunk(200 + i, CHUNK) for i in range(3)]) == 3
            wait_for_metric(server, 'lmcache_svc_errors_total{kind="tier_unavailable"}')
        finally:  # the session's Redis serves other tests next
            assert send_command(redis.port, "CLIENT", "UNPAUSE").startswith(b"+OK")
        # The failed writes marked the Redis tier down (its chunks are misses meanwhile);
        # the server's probe brings it back by itself once Redis answers again.
        wait_for_metric(server, 'lmcache_svc_tier_breaker_state{tier="redis"} 0.0', 60.0)
    with CacheClient(server.socket, timeout_s=10) as abandoning:  # a reservation, never used
        ns_id = abandoning.register_namespace(NS)
        slots = abandoning.prepare_store(ns_id, chunk_hashes(NS, [3] * NS.chunk_size))
        assert [s.status for s in slots] == ["reserved"]
    bad = f"{server.http_url}/v1/chunks/{NS.namespace_id.hex()}/{hashes[0].hex()}"
    assert httpx.put(bad, content=b"short", timeout=5).status_code == 400  # size_mismatch
    lookup = {"namespace_id": "00" * 16, "chunk_hashes": [hashes[0].hex()]}
    assert httpx.post(f"{server.http_url}/v1/lookup", json=lookup, timeout=5).status_code == 404


def drive_vllm(live: Stack) -> None:
    """A miss (stored into lmcache-svc), a local prefix hit, then external hits: one, and
    another after Prometheus has scraped the series the first one may have created (a
    series' first sample already holds it, so rate() would see no increase)."""
    assert live.vllm is not None
    stack.wait_http(live.vllm, "/health", VLLM_STARTUP_S)
    scraped_twice(live.prometheus, "vllm")
    stack.complete(live.vllm, live.model_dir, VLLM_PROMPT)
    stack.complete(live.vllm, live.model_dir, VLLM_PROMPT)
    reset_prefix_cache(live.vllm)
    stack.complete(live.vllm, live.model_dir, VLLM_PROMPT)
    scraped_twice(live.prometheus, "vllm")
    reset_prefix_cache(live.vllm)
    stack.complete(live.vllm, live.model_dir, VLLM_PROMPT)


def reset_prefix_cache(vllm: stack.Proc) -> None:
    """Empty vLLM's own prefix cache, so the next request's prefix comes from lmcache-svc."""
    for _ in range(20):  # fails while blocks are still held; retry briefly
        status, body = stack.http_post(f"{vllm.url}/reset_prefix_cache")
        if status == 200 and b"true" in body:
            return
        time.sleep(0.25)
    raise AssertionError(f"reset_prefix_cache failed: {status} {body!r}")


@pytest.fixture(scope="module")
def driven(live: Stack, redis_server: RedisProc) -> Iterator[Stack]:
    """The stack after traffic, with one lease still held (active leases > 0)."""
    hashes = chunk_hashes(NS, list(range(NUM_CHUNKS * NS.chunk_size)))
    with CacheClient(live.server.socket, timeout_s=10) as holder:
        ns_id = holder.register_namespace(NS)
        warm_up(holder, ns_id, hashes)
        scraped_twice(live.prometheus, "lmcache-svc")
        drive_server(live.server, redis_server)
        lease = holder.prepare_load(ns_id, hashes[-2:])
        assert lease.lease_id is not None
        if live.vllm is not None:
            drive_vllm(live)
        yield live
        holder.release_load(lease)


def evaluate(live: Stack, queries: list[dash.Query]) -> dict[dash.Query, dict[str, Any]]:
    """Each query's latest answer, polled until all have finite data or the deadline."""
    answers: dict[dash.Query, dict[str, Any]] = {}
    deadline = time.monotonic() + DATA_TIMEOUT_S
    pending = list(queries)
    while pending and time.monotonic() < deadline:
        for q in list(pending):
            answers[q] = stack.query(live.prometheus, q.promql(RATE_WINDOW))
            if finite_values(answers[q]):
                pending.remove(q)
        if pending:
            time.sleep(1.0)
    return answers


def describe(failures: dict[dash.Query, dict[str, Any]]) -> str:
    return "\n".join(
        f"  {q.panel} [{q.ref_id}]: {q.promql(RATE_WINDOW)}\n    -> "
        f"{a.get('error') or a.get('data', {}).get('result')}"
        for q, a in failures.items()
    )


def is_vllm(q: dash.Query) -> bool:
    return any(m.startswith("vllm:") for m in q.metric_names())


def test_every_server_and_redis_panel_returns_data(board: dict[str, Any], driven: Stack) -> None:
    queries = [q for q in dash.queries(board) if not is_vllm(q)]
    answers = evaluate(driven, queries)
    failures = {q: a for q, a in answers.items() if not finite_values(a)}
    assert not failures, f"{len(failures)} of {len(queries)} queries have no data:\n" + describe(
        failures
    )


def test_every_vllm_panel_returns_data(board: dict[str, Any], driven: Stack) -> None:
    queries = [q for q in dash.queries(board) if is_vllm(q)]
    assert queries
    if driven.vllm is None:  # still check that Prometheus parses them
        errors = {
            q: a
            for q in queries
            if (a := stack.query(driven.prometheus, q.promql(RATE_WINDOW)))["status"] != "success"
        }
        assert not errors, describe(errors)
        pytest.skip(f"no real vLLM: {driven.vllm_skip_reason}")
    answers = evaluate(driven, queries)
    failures = {q: a for q, a in answers.items() if not finite_values(a)}
    assert not failures, f"{len(failures)} of {len(queries)} queries have no data:\n" + describe(
        failures
    )


def test_template_variables_find_their_values(board: dict[str, Any], driven: Stack) -> None:
    for variable in dash.variables(board).values():
        if variable["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\(([\w:]+), (\w+)\)", variable["query"]["query"])
        assert m, variable["query"]
        if m.group(1).startswith("vllm:") and driven.vllm is None:
            continue
        metric, label = m.groups()
        answer = stack.api(driven.prometheus, f"/api/v1/label/{label}/values?match[]={metric}")
        assert answer["status"] == "success" and answer["data"], variable["name"]


def test_alert_rules_evaluate(driven: Stack) -> None:
    # a scrape after the traffic, then an evaluation of every rule after that scrape
    wait_for(driven.prometheus, f'timestamp(up{{job="lmcache-svc"}}) > {time.time()}', 30)
    rules = rules_evaluated_after(driven.prometheus, time.time())
    assert len(rules) == 5
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    assert {r["name"]: r["state"] for r in rules}["LMCacheSvcDown"] == "inactive"


def rules_evaluated_after(prometheus: stack.Proc, since: float) -> list[dict[str, Any]]:
    """The alert rules, once Prometheus has evaluated every one after ``since`` (Unix time)."""
    deadline = time.monotonic() + 30
    while True:
        groups = stack.api(prometheus, "/api/v1/rules")["data"]["groups"]
        rules: list[dict[str, Any]] = [r for g in groups for r in g["rules"]]
        evaluated = [datetime.fromisoformat(r["lastEvaluation"]).timestamp() for r in rules]
        if rules and min(evaluated) > since:
            return rules
        assert time.monotonic() < deadline, f"not every rule was evaluated after {since}: {rules}"
        time.sleep(0.25)

"""``bench routing``: the router forwards requests byte for byte and routes them round robin
or by a KV index's answer; the quick mode end to end (two ``vllm serve``, their sidecars,
Dynamo's indexer, ``vllm bench serve``): structure and sanity, never timings."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lmcache_svc_bench.routing_proxy import Router, by_index, round_robin
from lmcache_svc_bench.runner import run_benchmark
from lmcache_svc_bench.vllm.engines import VLLM_PYTHON
from tests.events.dynamo import DYNAMO_PYTHON


class _Echo(BaseHTTPRequestHandler):
    """A backend that answers which server it is and what it was sent."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        answer = json.dumps({"server": self.server.server_port, "body": body.decode()}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    do_GET = do_POST  # noqa: N815

    def log_message(self, *args: object) -> None:
        pass


class _Index(_Echo):
    """An index that says worker 2 holds every queried prompt's first 128 tokens."""

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        answer = json.dumps({"instances": {"2": {"longest_matched": 128, "disk": 128}}})
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer.encode())


@pytest.fixture
def servers() -> Iterator[list[ThreadingHTTPServer]]:
    made = [ThreadingHTTPServer(("127.0.0.1", 0), h) for h in (_Echo, _Echo, _Index)]
    for s in made:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield made
    for s in made:
        s.shutdown()


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


def test_round_robin_alternates_and_forwards_the_request_unchanged(servers) -> None:
    a, b, _ = servers
    backends = [("127.0.0.1", a.server_port), ("127.0.0.1", b.server_port)]
    router = Router(backends, round_robin(), {"t5": 5}).start()
    try:
        body = {"prompt": "t5 t5", "max_tokens": 1}
        answers = [_post(router.url, body) for _ in range(4)]
    finally:
        router.stop()
    assert [x["server"] for x in answers] == [a.server_port, b.server_port] * 2
    assert all(json.loads(x["body"]) == body for x in answers)
    assert router.routed == [2, 2]


def _served_by_index(servers: list[ThreadingHTTPServer]) -> tuple[set[int], Router]:
    """The backends that answered three one-at-a-time requests routed by the index."""
    a, b, index = servers
    backends = [("127.0.0.1", a.server_port), ("127.0.0.1", b.server_port)]
    # A timeout far past any answer: a host short of CPU must not turn the index's test into
    # one of the index-down fallback (load alone decides, so the first worker gets it).
    policy = by_index(f"http://127.0.0.1:{index.server_port}", timeout_s=60.0)
    router = Router(backends, policy, {f"t{i}": i for i in range(200)}).start()
    try:
        answers = [_post(router.url, {"prompt": "t1 t2 t3"}) for _ in range(3)]
    finally:
        router.stop()
    return {x["server"] for x in answers}, router


def test_the_index_policy_sends_a_prompt_to_the_worker_holding_its_prefix(servers) -> None:
    served, router = _served_by_index(servers)
    assert served == {servers[1].server_port}
    assert router.tokens_of({"prompt": "t1 t2 x t3"}) == [1, 2, 3]


def test_with_the_index_down_load_alone_decides(servers) -> None:
    index = servers[2]
    index.shutdown()
    index.server_close()  # nothing listens there any more: the query is refused
    served, _ = _served_by_index(servers)
    # One request at a time: no load anywhere, so the tie goes to the first worker.
    assert served == {servers[0].server_port}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_quick_mode_end_to_end(tmp_path: Path) -> None:
    if not VLLM_PYTHON.exists() or not DYNAMO_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} is missing: run scripts/setup_vllm.sh first (CI does)")
    options = {"num_users": "4", "num_turns": "3", "system_tokens": "512", "num_blocks": "24"}
    report = run_benchmark("routing", quick=True, out_dir=tmp_path, options=options)
    table = report.tables[0]
    assert [row[0] for row in table.rows] == ["rr", "events"]
    assert all(row[-1] == 12 for row in table.rows)  # every request completed
    rr, _ = table.rows
    per_engine = [int(n) for n in rr[7].split("/")]
    assert min(per_engine) > 0 and sum(per_engine) >= 12  # both engines served requests
    assert {t.name.split(" (")[0] for t in report.targets} == {
        "TTFT p99, rr / events",
        "store path with events vs without",
    }

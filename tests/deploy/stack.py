"""Real processes for the dashboard test: Prometheus, redis_exporter and a CPU vLLM API
server with the plugin. Each runs in its own process group on free loopback ports, logs to
a file, is waited for with a deadline, and ``stop()`` ends exactly the group it started.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lmcache_svc_bench.procs import free_port
from tests.deploy.manifests import REPO, VLLM_PYTHON

PROMETHEUS = "prometheus"
REDIS_EXPORTER = "prometheus-redis-exporter"  # Debian's name for oliver006/redis_exporter
ALERTS_FILE = REPO / "deploy" / "prometheus" / "alerts.yml"


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    url: str

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM to the process group started here, then SIGKILL after ``timeout_s``."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        try:  # children (vLLM's engine core) may outlive the leader briefly
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _spawn(
    name: str, cmd: list[str], workdir: Path, url: str, env: dict[str, str] | None = None
) -> Proc:
    log_path = workdir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
    return Proc(name, proc, log_path, url)


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def http_post(
    url: str, body: dict[str, Any] | None = None, timeout_s: float = 60.0
) -> tuple[int, bytes]:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_http(proc: Proc, path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited {proc.proc.poll()}:\n{proc.log_tail()}")
        if http_get(proc.url + path, timeout_s=2)[0] == 200:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} not ready in {timeout_s} s:\n{proc.log_tail()}")


# -- Prometheus ------------------------------------------------------------------------------------


def start_prometheus(
    workdir: Path, targets: dict[str, str], *, interval_s: float = 1.0, timeout_s: float = 30.0
) -> Proc:
    """Prometheus scraping ``targets`` (job -> host:port) every ``interval_s`` and
    evaluating deploy/prometheus/alerts.yml."""
    binary = shutil.which(PROMETHEUS)
    assert binary is not None, "prometheus is not on PATH"
    config = {
        "global": {
            "scrape_interval": f"{int(interval_s * 1000)}ms",
            "evaluation_interval": f"{int(interval_s * 1000)}ms",
        },
        "rule_files": [str(ALERTS_FILE)],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [target]}]}
            for job, target in targets.items()
        ],
    }
    config_file = workdir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    proc = _spawn(PROMETHEUS, [
        binary, f"--config.file={config_file}", f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
    ], workdir, f"http://127.0.0.1:{port}")  # fmt: skip
    try:
        wait_http(proc, "/-/ready", timeout_s)
    except BaseException:
        proc.stop()
        raise
    return proc


def query(prometheus: Proc, promql: str) -> dict[str, Any]:
    """GET /api/v1/query; the decoded JSON (status, data or error)."""
    url = f"{prometheus.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    _, body = http_get(url)
    answer: dict[str, Any] = json.loads(body or b'{"status": "error", "error": "no answer"}')
    return answer


def api(prometheus: Proc, path: str) -> dict[str, Any]:
    _, body = http_get(prometheus.url + path)
    answer: dict[str, Any] = json.loads(body)
    return answer


# -- redis_exporter --------------------------------------------------------------------------------


def start_redis_exporter(workdir: Path, redis_url: str, timeout_s: float = 15.0) -> Proc:
    binary = shutil.which(REDIS_EXPORTER)
    assert binary is not None, f"{REDIS_EXPORTER} is not on PATH"
    port = free_port()
    proc = _spawn("redis-exporter", [
        binary, f"-redis.addr={redis_url}", f"-web.listen-address=127.0.0.1:{port}",
    ], workdir, f"http://127.0.0.1:{port}")  # fmt: skip
    try:
        wait_http(proc, "/metrics", timeout_s)
    except BaseException:
        proc.stop()
        raise
    return proc


# -- vLLM ------------------------------------------------------------------------------------------


def vllm_available() -> str | None:
    """Why a real vLLM cannot run here, or None when it can."""
    if not VLLM_PYTHON.exists():
        return f"{VLLM_PYTHON} is missing (scripts/setup_vllm.sh creates it)"
    return None


def start_vllm(workdir: Path, model_dir: Path, socket_path: str) -> Proc:
    """vLLM's OpenAI API server on the CPU with the plugin talking to ``socket_path``.

    No tokenizer (prompts are token ids); VLLM_SERVER_DEV_MODE enables
    POST /reset_prefix_cache, which the test uses to turn local hits into external ones.
    Returns at once: call ``wait_http(proc, "/health", ...)`` before using it.
    """
    port = free_port()
    kv = {
        "kv_connector": "LMCacheSvcConnector",
        "kv_connector_module_path": "lmcache_svc_vllm",
        "kv_role": "kv_both",
        # 256-token chunks pinned: 512 KiB of the tiny model, the size of test_dashboard's own
        # chunks (one size class in the arena); the plugin's default would be 128 tokens.
        "kv_connector_extra_config": {"url": socket_path, "chunk_size": 256},
    }
    cmd = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16",
        "--max-model-len", "2048", "--block-size", "128", "--max-num-seqs", "4",
        "--host", "127.0.0.1", "--port", str(port), "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "DO_NOT_TRACK": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    return _spawn("vllm", cmd, workdir, f"http://127.0.0.1:{port}", env)


def complete(vllm: Proc, model_dir: Path, prompt: list[int], max_tokens: int = 2) -> None:
    status, body = http_post(f"{vllm.url}/v1/completions", {
        "model": str(model_dir), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
    })  # fmt: skip
    assert status == 200, f"completion failed ({status}): {body[:500]!r}\n{vllm.log_tail()}"

"""``vllm serve`` and ``vllm bench serve`` as processes of the vLLM venv, and Prometheus
text scraped from a ``/metrics`` endpoint.

Both run through ``workload_vllm_cli`` (vLLM's own CLI entry point; see that module for why
not the ``vllm`` console script). The server runs in its own process group, which ``stop``
ends as a whole (vLLM's engine core is a child process).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache_svc_bench.held_signals import start_process
from lmcache_svc_bench.procs import free_port
from lmcache_svc_bench.vllm.engines import REPO, SITE, VLLM_PYTHON
from lmcache_svc_bench.vllm_common import BENCH_ENV

CLI_MODULE = "lmcache_svc_bench.workload_vllm_cli"
STARTUP_TIMEOUT_S = 300.0
SERVED_NAME = "bench-model"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def vllm_env() -> dict[str, str]:
    return {
        **os.environ,
        **BENCH_ENV,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # an upper bound; --num-gpu-blocks-override sizes it
        "PYTHONHASHSEED": "0",  # the client's trace expansion hashes strings
        # the CLI shim's module, from this checkout; the engines' AMX permission (SITE)
        "PYTHONPATH": os.pathsep.join([str(REPO / "benchmarks"), str(SITE)]),
    }


@dataclass
class VllmServer:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    startup_s: float

    @classmethod
    def start(
        cls,
        model_dir: Path,
        log_path: Path,
        serve_args: list[str],
        *,
        timeout_s: float = STARTUP_TIMEOUT_S,
        env: dict[str, str] | None = None,
    ) -> VllmServer:
        port = free_port()
        cmd = [
            str(VLLM_PYTHON), "-m", CLI_MODULE, "serve", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
            *serve_args,
        ]  # fmt: skip
        start = time.monotonic()
        with open(log_path, "wb") as log:
            proc = start_process(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**vllm_env(), **(env or {})},
                start_new_session=True,
            )
        server = cls(proc, f"http://127.0.0.1:{port}", log_path, 0.0)
        try:
            server._wait_healthy(start + timeout_s)
        except BaseException:
            server.stop()
            raise
        server.startup_s = time.monotonic() - start
        return server

    def _wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited ({self.proc.returncode}):\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vllm serve not healthy in time:\n{self.log_tail()}")

    def complete(self, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
        """One completion through the OpenAI API (for the warm-up)."""
        body = {
            "model": SERVED_NAME,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        request = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as answer:
            result: dict[str, Any] = json.loads(answer.read())
        return result

    def metrics(self) -> Metrics:
        return scrape(self.url + "/metrics")

    def log_tail(self, num_chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # the engine core and anything else left in the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


class Metrics:
    """Samples of one Prometheus text page: ``sum(name, **labels)`` adds every series of
    ``name`` whose labels include ``labels``."""

    def __init__(self, text: str) -> None:
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for line in text.splitlines():
            match = _SAMPLE.match(line.strip())
            if match is None or line.startswith("#"):
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            try:
                self.samples.append((match.group(1), labels, float(match.group(3))))
            except ValueError:
                continue

    def sum(self, name: str, **labels: str) -> float:
        return sum(
            value
            for sample_name, sample_labels, value in self.samples
            if sample_name == name and all(sample_labels.get(k) == v for k, v in labels.items())
        )

    def label_values(self, name: str, label: str) -> set[str]:
        return {labels[label] for n, labels, _ in self.samples if n == name and label in labels}


def scrape(url: str) -> Metrics:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return Metrics(answer.read().decode())


def run_client(args: list[str], log_path: Path, timeout_s: float) -> float:
    """``vllm bench serve`` with ``args``; returns its wall time. Raises with the tail of
    its output when it fails."""
    cmd = [str(VLLM_PYTHON), "-m", CLI_MODULE, "bench", "serve", *args]
    start = time.monotonic()
    with open(log_path, "wb") as log:
        done = subprocess.run(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=vllm_env(),
            timeout=timeout_s,
            check=False,
        )
    if done.returncode != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{tail}")
    return time.monotonic() - start

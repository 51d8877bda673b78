"""NVIDIA Dynamo's standalone KV indexer (``.venv-dynamo``, scripts/setup_dynamo.sh) as a
router index no one here wrote: it subscribes to vLLM-format ZMQ streams and scores
workers by the prefix of a query's tokens they hold, per tier. It binds its HTTP port on
0.0.0.0 (it has no host option); the tests only talk to it over loopback."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lmcache_svc_bench.procs import free_port

DYNAMO_PYTHON = Path(__file__).resolve().parents[2] / ".venv-dynamo" / "bin" / "python"


def require_dynamo() -> None:
    if not DYNAMO_PYTHON.exists():
        pytest.skip(f"{DYNAMO_PYTHON} is missing: run scripts/setup_dynamo.sh first (CI does)")


@dataclass
class Indexer:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @classmethod
    def start(cls, workers: dict[int, str], block_size: int, log_dir: Path) -> Indexer:
        port = free_port()
        log_path = log_dir / f"dynamo-{port}.log"
        spec = ",".join(f"{w}={endpoint}" for w, endpoint in workers.items())
        proc = subprocess.Popen(
            [str(DYNAMO_PYTHON), "-m", "dynamo.indexer", "--block-size", str(block_size),
             "--port", str(port), "--threads", "1", "--workers", spec],
            stdout=open(log_path, "wb"),  # noqa: SIM115 - the child owns it
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        indexer = cls(proc, port, log_path)
        deadline = time.monotonic() + 30
        while True:
            try:
                indexer.query([1])
                return indexer
            except (urllib.error.URLError, ConnectionError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    indexer.stop()
                    raise RuntimeError(f"dynamo.indexer did not start: {indexer.log()}") from None
                time.sleep(0.2)

    def query(self, token_ids: list[int]) -> dict[str, Any]:
        body = json.dumps({"token_ids": token_ids, "model_name": "default"}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/query",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            return dict(json.loads(response.read()))

    def matched(self, token_ids: list[int], worker: int, tier: str) -> int:
        """Tokens of the query's prefix the worker holds, counted up to ``tier`` (gpu, cpu,
        disk: Dynamo's breakdown is cumulative)."""
        found = self.query(token_ids).get("instances", {}).get(str(worker))
        return int(found[tier]) if found else 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

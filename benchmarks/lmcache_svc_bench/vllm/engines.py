"""Drive ``engine_runner.py`` processes from the test venv (JSON lines, with deadlines).

Each ``EngineProc`` is one vLLM engine in its own process tree, run with the vLLM venv's
interpreter. Every exchange has a deadline; on a timeout or an engine that died, the error
carries the tail of the engine's log. ``close`` ends the whole process group it started.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcache_svc_bench.held_signals import start_process

REPO = Path(__file__).resolve().parents[3]
RUNNER = Path(__file__).with_name("engine_runner.py")
# Every engine process imports its ``sitecustomize`` (AMX permission: see there).
SITE = Path(__file__).with_name("site")


def _vllm_python() -> Path:
    """The vLLM venv's interpreter: ``LMCACHE_SVC_VLLM_PYTHON``, else the checkout's."""
    configured = os.environ.get("LMCACHE_SVC_VLLM_PYTHON")
    if configured:
        return Path(configured)
    return REPO / ".venv-vllm" / "bin" / "python"


VLLM_PYTHON = _vllm_python()
STARTUP_TIMEOUT_S = 240.0
# vLLM's CPU backend reserves one more core when any KV connector is configured: on a
# 2-core machine an engine with a connector computes on two OpenMP threads and one without
# on one, and the different reductions flip near-tied greedy tokens. Every engine started
# here reserves one core (``env=`` can override it), so engines compared with each other
# compute alike.
SAME_COMPUTE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
REQUEST_TIMEOUT_S = 120.0


def kv_transfer_config(
    url: str,
    *,
    connector: str = "LMCacheSvcConnector",
    module: str = "lmcache_svc_vllm",
    **extra: Any,
) -> dict[str, Any]:
    return {
        "kv_connector": connector,
        "kv_connector_module_path": module,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"url": url, **extra},
    }


def example_connector_config(storage_dir: Path, *, prefix_match: bool = True) -> dict[str, Any]:
    """vLLM's ExampleConnector (safetensors files in ``storage_dir``). ``prefix_match``: the
    ``example_prefix`` subclass, which also hits a stored block-aligned prefix of a prompt
    (the stock connector only hits a prompt stored whole)."""
    if prefix_match:
        connector, module = "ExamplePrefixConnector", "example_prefix"
    else:
        connector = "ExampleConnector"
        module = "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"
    return {
        "kv_connector": connector,
        "kv_connector_module_path": module,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
    }


@dataclass
class EngineProc:
    name: str
    proc: subprocess.Popen[str]
    log_path: Path
    startup_s: float = 0.0
    _answers: queue.Queue[str | None] = field(default_factory=queue.Queue)

    @classmethod
    def start(
        cls,
        name: str,
        model_dir: Path,
        log_dir: Path,
        *,
        kv_config: dict[str, Any] | None = None,
        kv_events_config: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        python_path: list[Path] | None = None,
        prefix_caching: bool = True,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        kv_cache_gib: int = 1,
    ) -> EngineProc:
        """``python_path``: extra import directories (e.g. a test's own connector module).
        ``prefix_caching=False`` turns vLLM's own prefix cache off; ``kv_cache_gib`` sets
        ``VLLM_CPU_KVCACHE_SPACE`` (default 1 GiB)."""
        args = [str(VLLM_PYTHON), str(RUNNER), "--model", str(model_dir)]
        if kv_config is not None:
            args += ["--kv-config", json.dumps(kv_config)]
        if kv_events_config is not None:
            args += ["--kv-events-config", json.dumps(kv_events_config)]
        if not prefix_caching:
            args.append("--no-prefix-caching")
        if max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        if max_model_len is not None:
            args += ["--max-model-len", str(max_model_len)]
        run_env = {
            **os.environ,
            **SAME_COMPUTE_ENV,
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "PYTHONPATH": os.pathsep.join(
                str(p) for p in [RUNNER.parent, SITE, *(python_path or [])]
            ),
            **(env or {}),
        }
        log_path = log_dir / f"engine-{name}.log"
        engine: EngineProc | None = None
        try:
            proc = start_process(  # a Ctrl-C or SIGTERM meanwhile: killed, raised
                args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(log_path, "w"),  # noqa: SIM115 - the child owns it
                text=True,
                env=run_env,
                start_new_session=True,
            )
            engine = cls(name, proc, log_path)
            threading.Thread(target=engine._read_answers, daemon=True).start()
            ready = engine._next_answer(STARTUP_TIMEOUT_S)
        except BaseException:  # a failed or interrupted start must not leave a process
            if engine is not None:
                engine.close(timeout_s=5)
            raise
        engine.startup_s = float(ready["startup_s"])
        return engine

    def _read_answers(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._answers.put(line)
        self._answers.put(None)

    def _next_answer(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(
                f"engine {self.name}: no answer in {timeout_s} s\n{self.log_tail()}"
            ) from None
        if line is None:
            raise AssertionError(
                f"engine {self.name} exited ({self.proc.poll()})\n{self.log_tail()}"
            )
        answer: dict[str, Any] = json.loads(line)
        if not answer.get("ok"):
            raise AssertionError(f"engine {self.name}: {answer.get('error')}\n{self.log_tail()}")
        return answer

    def request(self, timeout_s: float = REQUEST_TIMEOUT_S, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._next_answer(timeout_s)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        *,
        margins: bool = False,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> list[dict[str, Any]]:
        """Greedy outputs; ``margins=True`` adds each token's top-1 minus top-2 logprob."""
        outputs: list[dict[str, Any]] = self.request(
            timeout_s, op="generate", prompts=prompts, max_tokens=max_tokens, margins=margins
        )["outputs"]
        return outputs

    def ttft(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        """One streamed request: ``ttft_s``, ``elapsed_s``, ``token_ids``, ``num_cached_tokens``
        (timed inside the engine process, so the JSON pipe is not counted)."""
        answer = self.request(op="ttft", prompt=prompt, max_tokens=max_tokens)
        answer.pop("ok", None)
        return answer

    def metrics(self) -> dict[str, float]:
        metrics: dict[str, float] = self.request(op="metrics")["metrics"]
        return metrics

    def reset_prefix_cache(self) -> None:
        assert self.request(op="reset_prefix_cache")["reset"], "vLLM refused to reset its cache"

    def log_tail(self, num_chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def close(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        else:  # vLLM's engine-core or worker processes could outlive a crashed runner
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)

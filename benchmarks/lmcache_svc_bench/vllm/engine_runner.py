"""Run one vLLM engine in this process and drive it with JSON lines (run with .venv-vllm).

    python engine_runner.py --model DIR [--kv-config JSON] [--kv-events-config JSON] ...

Commands, one JSON object per line on stdin; one JSON answer per line on the original
stdout (everything vLLM prints goes to stderr):

    {"op": "generate", "prompts": [[ids...], ...], "max_tokens": 8, "margins": false}
        -> {"ok": true, "outputs": [{"token_ids": [...], "num_cached_tokens": n}], "elapsed_s": t}
        with ``"margins": true`` each output also has ``"margins"``: per generated token,
        its logprob minus the runner-up's (how far each greedy choice is from a tie).
    {"op": "ttft", "prompt": [ids...], "max_tokens": 8}
        -> {"ok": true, "ttft_s": t, "elapsed_s": t, "token_ids": [...], "num_cached_tokens": n,
            "marks": [[ms, name], ...]}
        one request, streamed: ``ttft_s`` runs from handing the request to the engine
        (``LLMEngine.add_request``) to the first step that returns a generated token.
        ``marks``: with ``LMCACHE_SVC_VLLM_TRACE`` set, every trace mark (this process's
        steps, the plugin's hooks and phases) up to the first token.
    {"op": "metrics"}             -> {"ok": true, "metrics": {"name{label=value}": number}}
    {"op": "reset_prefix_cache"}  -> {"ok": true}   (empties vLLM's own prefix cache)
    {"op": "log_stats"}           -> {"ok": true}   (vLLM logs its stats now, incl. the
                                                      plugin's "KV Transfer metrics" line)
    {"op": "exit"}

The first line written is {"ok": true, "event": "ready", "startup_s": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, TextIO


def _claim_stdout() -> TextIO:
    """Keep the real stdout for answers; send fd 1 (ours and children's) to stderr."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return answers


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--kv-config", default=None, help="kv_transfer_config as JSON")
    p.add_argument("--kv-events-config", default=None, help="kv_events_config as JSON")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prefix-caching", action="store_true", help="vLLM's own prefix cache off")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    return p.parse_args()


def _make_llm(args: argparse.Namespace) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if args.kv_config:
        kwargs["kv_transfer_config"] = json.loads(args.kv_config)
    if args.kv_events_config:
        from vllm.config.kv_events import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**json.loads(args.kv_events_config))
    if args.no_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    return LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        seed=args.seed,
        disable_log_stats=False,
        **kwargs,
    )


def _generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    margins = bool(cmd.get("margins"))
    params = SamplingParams(
        temperature=0.0,
        max_tokens=int(cmd["max_tokens"]),
        ignore_eos=True,
        logprobs=2 if margins else None,
    )
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in cmd["prompts"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    results = []
    for o in outputs:
        result: dict[str, Any] = {
            "token_ids": list(o.outputs[0].token_ids),
            "num_cached_tokens": o.num_cached_tokens,
        }
        if margins:
            result["margins"] = [_margin(step) for step in o.outputs[0].logprobs]
        results.append(result)
    return {"outputs": results, "elapsed_s": elapsed}


def _margin(step_logprobs: dict[int, Any]) -> float:
    """Top-1 minus top-2 logprob of one generated token (0.0: a tie)."""
    top = sorted((lp.logprob for lp in step_logprobs.values()), reverse=True)
    return float(top[0] - top[1]) if len(top) > 1 else float("inf")


def _ttft(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """One request through ``LLMEngine.step``, as a streaming client sees it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("ttft needs an idle engine")
    params = SamplingParams(temperature=0.0, max_tokens=int(cmd["max_tokens"]), ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=list(cmd["prompt"]))
    first: float | None = None
    final: Any = None
    mark = _trace_mark()
    start_ns = time.perf_counter_ns()
    start = time.perf_counter()
    mark("ttft.add")
    engine.add_request(f"ttft-{time.monotonic_ns()}", prompt, params)
    while engine.has_unfinished_requests():
        mark("step>")
        outputs = engine.step()
        mark("step<")
        for out in outputs:
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter() - start
                mark("ttft.first")
            if out.finished:
                final = out
    elapsed = time.perf_counter() - start
    if final is None or first is None:
        raise RuntimeError("the request finished without output")
    return {
        "ttft_s": first,
        "elapsed_s": elapsed,
        "token_ids": list(final.outputs[0].token_ids),
        "num_cached_tokens": final.num_cached_tokens,
        "marks": _marks_until_first(start_ns, first),
    }


def _trace_mark() -> Any:
    """The plugin's trace marks (``lmcache_svc_vllm/trace.py``) when ``LMCACHE_SVC_VLLM_TRACE``
    is set, so this process's marks and the engine's share one file and one clock."""
    if not os.environ.get("LMCACHE_SVC_VLLM_TRACE"):
        return lambda name: None
    try:
        from lmcache_svc_vllm import trace
    except ImportError:  # a plugin without trace marks (an older one, for a comparison)
        return lambda name: None
    return trace.mark


def _marks_until_first(start_ns: int, first_s: float) -> list[tuple[float, str]]:
    """Every process's marks from ``add_request`` to the first token: (ms from the start,
    name); empty when tracing is off."""
    path = os.environ.get("LMCACHE_SVC_VLLM_TRACE")
    if not path or not os.path.exists(path):
        return []
    try:
        from lmcache_svc_vllm import trace
    except ImportError:
        return []

    end_ns = start_ns + int(first_s * 1e9) + 1_000_000  # the first token's own mark
    # Marks are written a little later than they are taken (trace.py): this process's now,
    # the engine's processes' within SETTLE_S of the first token.
    getattr(trace, "flush", lambda: None)()
    settle_ns = int(getattr(trace, "SETTLE_S", 0.0) * 1e9)
    wait_s = (end_ns + settle_ns - time.perf_counter_ns()) / 1e9
    if wait_s > 0:
        time.sleep(wait_s)
    return [((ns - start_ns) / 1e6, name) for ns, name in trace.read_marks(path, start_ns, end_ns)]


def _metrics(llm: Any) -> dict[str, Any]:
    from vllm.v1.metrics.reader import Counter, Histogram

    out: dict[str, float] = {}
    for m in llm.get_metrics():
        labels = ",".join(
            f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("engine", "model_name")
        )
        key = f"{m.name}{{{labels}}}" if labels else m.name
        if isinstance(m, Counter):
            out[key] = out.get(key, 0) + m.value
        elif isinstance(m, Histogram):
            out[key + ":count"] = out.get(key + ":count", 0) + m.count
            out[key + ":sum"] = out.get(key + ":sum", 0.0) + m.sum
    return {"metrics": out}


def _serve(llm: Any, answers: TextIO) -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "exit":
            return
        try:
            if op == "generate":
                result = _generate(llm, cmd)
            elif op == "ttft":
                result = _ttft(llm, cmd)
            elif op == "metrics":
                result = _metrics(llm)
            elif op == "reset_prefix_cache":
                result = {"reset": bool(llm.reset_prefix_cache())}
            elif op == "log_stats":
                llm.llm_engine.do_log_stats()
                result = {}
            else:
                raise ValueError(f"unknown op {op!r}")
            answers.write(json.dumps({"ok": True, **result}) + "\n")
        except Exception as e:  # report to the driver, keep serving
            answers.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")


def main() -> None:
    answers = _claim_stdout()
    args = _parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    llm = _make_llm(args)
    answers.write(
        json.dumps({"ok": True, "event": "ready", "startup_s": time.perf_counter() - start}) + "\n"
    )
    _serve(llm, answers)


if __name__ == "__main__":
    main()

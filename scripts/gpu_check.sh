#!/usr/bin/env bash
# The GPU paths on a CUDA machine: two-process correctness through the arena (vLLM 0.32's
# CUDA KV layout), the HBM tier over CUDA IPC, and the benchmarks with their same-run
# baselines. Needs only a CUDA build of torch and this repository (no network).
# Usage: scripts/gpu_check.sh [--gib 1] [--repeats 5] [--skip-bench]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
cd "$root"
PYTHONPATH="$root:$root/connectors/vllm${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m tests.gpu.check "$@"

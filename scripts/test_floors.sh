#!/usr/bin/env bash
# The floors declared are the floors tested: .venv-floors holds every direct dependency of
# lmcache-svc (the base ones and the server extras) at the lowest version pyproject.toml
# allows (scripts/lib/floor_constraints.py pins each to its floor: pip has no
# lowest-versions resolution), on Python 3.11 (requires-python's floor), and the unit tests
# run in it. Not run here: vLLM, deploy and GPU tests, the tests marked vllm elsewhere (the
# events tests that start engines; their sidecars' code is covered by the unit tests here),
# the benchmarks' quick modes and the KVCacheMemory API (they need torch, transformers or
# vLLM, whose versions their own venvs pin), the generated-code check (grpcio-tools is
# pinned) and the skip check's own tests (pytest's, not the dependencies'). The test tools
# (pytest, httpx, schemathesis, safetensors) are not floors: they install at their newest.
#
# Usage: scripts/test_floors.sh [pytest args]     (scripts/test.sh runs it; VENV, PYTHON)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${VENV:-$root/.venv-floors}
py=${PYTHON:-$(command -v python3.11 || command -v python3)}
inputs=$(cat pyproject.toml benchmarks/pyproject.toml "$0" scripts/lib/floor_constraints.py \
  | sha256sum | cut -c1-16)
stamp=$venv/.floors-$inputs
if [ ! -f "$stamp" ]; then
  echo "test_floors: building $venv (the declared floors) with $py"
  rm -rf "$venv"
  "$py" -m venv "$venv"
  pip=("$venv/bin/python" -m pip --disable-pip-version-check)
  "$venv/bin/python" scripts/lib/floor_constraints.py "$venv/floors.txt" --extras server
  "${pip[@]}" install -q -c "$venv/floors.txt" -e '.[server]' -e ./benchmarks \
    pytest pytest-timeout httpx schemathesis safetensors \
    2> >(grep -v "is ignored: it is neither" >&2)
  touch "$stamp"
fi
"$venv/bin/python" scripts/lib/floor_constraints.py --check "$venv/floors.txt"
exec "$venv/bin/python" -m pytest -q -rs -p tests.skip_check -p no:cacheprovider tests \
  --ignore=tests/vllm --ignore=tests/deploy --ignore=tests/gpu --ignore=tests/bench \
  --ignore=tests/kv_memory --ignore=tests/tiers/test_hbm.py --ignore=tests/test_proto.py \
  --ignore=tests/test_skip_check.py \
  -k "not hbm" -m "not vllm" "$@"

#!/usr/bin/env bash
# Set up everything on a fresh machine (venv, torch CPU wheel, redis-server, the vLLM
# venv for the end-to-end tests) and run the test suite. Extra arguments go to pytest.
# Without test paths among them, the unit tests then run again on the lowest versions of
# the dependencies pyproject.toml declares (scripts/test_floors.sh; LMCACHE_SVC_SKIP_FLOORS=1
# skips that).
# -rs lists every skipped test with its reason; tests.skip_check fails the run when a test
# skips for a reason not in its EXPECTED_SKIPS (docs/testing.md).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/setup.sh --dev
scripts/setup_ops.sh
if [ -z "${LMCACHE_SVC_SKIP_VLLM:-}" ] && [ -f scripts/setup_vllm.sh ]; then
  bash scripts/setup_vllm.sh
fi
status=0
.venv/bin/python -m pytest -q -rs -p tests.skip_check "$@" || status=$?
# The whole suite (no test paths given) also runs the unit tests on the declared floors.
paths=0
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then paths=$((paths + 1)); fi
done
if [ -z "${LMCACHE_SVC_SKIP_FLOORS:-}" ] && [ "$paths" = 0 ]; then
  scripts/test_floors.sh || status=$((status ? status : 1))
fi
exit "$status"

#!/usr/bin/env bash
# Set up everything on a fresh machine (venv, torch CPU wheel, redis-server, the vLLM
# venv for the end-to-end tests) and run the test suite. Extra arguments go to pytest.
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
bash scripts/setup_dynamo.sh  # NVIDIA Dynamo's KV indexer for tests/events
exec .venv/bin/python -m pytest -q -rs -p tests.skip_check "$@"

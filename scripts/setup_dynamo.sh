#!/usr/bin/env bash
# Create .venv-dynamo: NVIDIA Dynamo's runtime from PyPI (ai-dynamo-runtime), whose standalone
# KV indexer (`python -m dynamo.indexer`) the event tests use as a router index no one here
# wrote (tests/events, docs/events.md). Idempotent: a stamp records what was installed.
#
# Usage: scripts/setup_dynamo.sh      VENV=<dir> to put it elsewhere (default <repo>/.venv-dynamo)
set -euo pipefail
DYNAMO_VERSION=1.6.1
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$root/.venv-dynamo}
stamp=$venv/.setup-stamp
want="ai-dynamo-runtime==$DYNAMO_VERSION"
if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]] \
  && "$venv/bin/python" -c "import dynamo.indexer" 2>/dev/null; then
  echo "setup_dynamo: up to date: $venv"
  exit 0
fi
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "$want"
"$venv/bin/python" -c "import dynamo.indexer"
echo "$want" > "$stamp"
echo "setup_dynamo: done: $venv"

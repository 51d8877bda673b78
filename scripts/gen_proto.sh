#!/usr/bin/env bash
# Regenerate the gRPC/protobuf Python code from proto/ into lmcache_svc/v1/.
# Usage: scripts/gen_proto.sh [OUT_DIR]   (default: the repository root)
# The generated files are checked in; tests/test_proto.py checks they match this script.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root}
py=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$out/lmcache_svc/v1"
"$py" -m grpc_tools.protoc -I "$root/proto" \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  "$root"/proto/lmcache_svc/v1/*.proto
touch "$out/lmcache_svc/v1/__init__.py"

#!/usr/bin/env bash
# Set up (first run only) and run the cache server on embedded defaults:
# a 1 GiB shared-memory arena, gRPC on 127.0.0.1:50051 and a Unix socket, REST on
# 127.0.0.1:8080. Extra arguments go to `lmcache-svc serve` (see --help).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh" >&2
exec "$root/.venv/bin/lmcache-svc" serve "$@"

#!/usr/bin/env bash
# Set up the project on a fresh machine: a virtualenv in .venv with lmcache-svc installed.
#   scripts/setup.sh          server + client (what `lmcache-svc serve` needs)
#   scripts/setup.sh --dev    also test tools, the torch CPU wheel and redis-server
# Idempotent and quick when nothing changed (a stamp keyed on pyproject.toml).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
dev=0
[ "${1:-}" = "--dev" ] && dev=1
py=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$py" -m venv .venv
fi
pip=".venv/bin/python -m pip"
stamp=".venv/.lmcache-svc-setup-$dev-$(cat pyproject.toml benchmarks/pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  if [ "$dev" = 1 ]; then
    echo "setup: installing torch (CPU build) and the project with test extras"
    # torch first, pinned: a later unpinned 'torch' requirement then installs nothing more.
    $pip install -q --disable-pip-version-check torch==2.13.0
    $pip install -q --disable-pip-version-check -e '.[server,dev,torch]' -e ./benchmarks
  else
    echo "setup: installing the project with server extras"
    $pip install -q --disable-pip-version-check -e '.[server]'
  fi
  touch "$stamp"
fi

if [ "$dev" = 1 ] && ! command -v redis-server >/dev/null 2>&1; then
  echo "setup: installing redis-server (Debian package)"
  sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq redis-server >/dev/null
fi
echo "setup: done"

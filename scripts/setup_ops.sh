#!/usr/bin/env bash
# Install the operations tools the deployment tests (tests/deploy) use, from Debian
# packages, when they are absent:
#   prometheus                 + promtool: scrape a real server, evaluate the dashboard's
#                              queries and the alert rules, check deploy/prometheus
#   prometheus-redis-exporter  Redis's own metrics for the dashboard's Redis panels
#   docker-compose             `docker-compose config` on both profiles (no engine needed)
# Idempotent: does nothing when all are on PATH. Needs root or sudo to install. The
# packages' own services are not used (the tests start their own processes on free
# loopback ports).
set -euo pipefail

declare -A command_of=(
  [prometheus]=prometheus
  [prometheus-redis-exporter]=prometheus-redis-exporter
  [docker-compose]=docker-compose
)
missing=()
for package in "${!command_of[@]}"; do
  command -v "${command_of[$package]}" >/dev/null 2>&1 || missing+=("$package")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup_ops: prometheus, prometheus-redis-exporter and docker-compose present"
  exit 0
fi

sudo_cmd=""
[ "$(id -u)" = 0 ] || sudo_cmd="sudo"
echo "setup_ops: installing ${missing[*]} (Debian packages)"
$sudo_cmd apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends \
  "${missing[@]}" >/dev/null
for package in "${missing[@]}"; do
  if ! command -v "${command_of[$package]}" >/dev/null 2>&1; then
    echo "setup_ops: ${command_of[$package]} still missing after installing $package" >&2
    exit 1
  fi
done
echo "setup_ops: done"

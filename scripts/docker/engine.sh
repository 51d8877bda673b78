#!/usr/bin/env bash
# A private Docker engine, apart from any other on the machine, for the container tests
# (tests/deploy/test_docker_stack.py) and for trying the images by hand:
#
#   scripts/docker/engine.sh start    start dockerd; prints DOCKER_HOST=unix://...
#   scripts/docker/engine.sh stop     stop the dockerd this script started (its pidfile's pid)
#   scripts/docker/engine.sh host     print DOCKER_HOST=unix://... (whether or not it runs)
#
# Everything it owns is its own: the socket, exec root (containerd's state) and pidfile
# under $LMCACHE_SVC_DOCKER_RUN (default /run/lmcache-svc-docker); the data root (images,
# build cache, volumes) under $LMCACHE_SVC_DOCKER_CACHE (default
# /var/cache/lmcache-svc-docker), kept between runs so that a second run reuses the images
# (nothing depends on it: an empty one only makes the first build slower); and the bridge
# lmcsvc0 (172.31.254.1/24) that containers on the default network (build steps) use.
# Needs root, as dockerd does, and Debian's docker.io (scripts/setup_ops.sh installs it).
set -euo pipefail

run_dir=${LMCACHE_SVC_DOCKER_RUN:-/run/lmcache-svc-docker}
cache_dir=${LMCACHE_SVC_DOCKER_CACHE:-/var/cache/lmcache-svc-docker}
socket=$run_dir/docker.sock
pidfile=$run_dir/dockerd.pid
log=$run_dir/dockerd.log
bridge=lmcsvc0
bridge_cidr=172.31.254.1/24

say() { echo "docker-engine: $*" >&2; }
die() { say "$*"; exit 1; }

answers() { DOCKER_HOST=unix://$socket timeout 10 docker version >/dev/null 2>&1; }

running_pid() {
  local pid
  [[ -f $pidfile ]] || return 1
  pid=$(cat "$pidfile")
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

start() {
  [[ $(id -u) == 0 ]] || die "dockerd needs root (run as root, or start an engine yourself)"
  command -v dockerd >/dev/null || die "dockerd is missing: scripts/setup_ops.sh installs docker.io"
  if pid=$(running_pid); then
    die "already running (pid $pid, $socket): stop it first"
  fi
  mkdir -p "$run_dir" "$cache_dir/data"
  if ! ip link show "$bridge" >/dev/null 2>&1; then
    ip link add name "$bridge" type bridge
    ip addr add "$bridge_cidr" dev "$bridge"
  fi
  ip link set "$bridge" up
  # setsid: its own session, so a signal to the caller's process group does not reach it.
  setsid dockerd \
    --host "unix://$socket" \
    --data-root "$cache_dir/data" \
    --exec-root "$run_dir/exec" \
    --pidfile "$pidfile" \
    --bridge "$bridge" \
    --storage-driver overlay2 \
    >"$log" 2>&1 </dev/null &
  local deadline=$((SECONDS + 60))
  until answers; do
    if ! kill -0 $! 2>/dev/null; then
      tail -n 30 "$log" >&2
      die "dockerd exited while starting (log: $log)"
    fi
    if ((SECONDS > deadline)); then
      tail -n 30 "$log" >&2
      kill $! 2>/dev/null || true
      die "dockerd did not answer in 60 s (log: $log)"
    fi
    sleep 0.5
  done
  say "started dockerd (pid $(cat "$pidfile")), data root $cache_dir/data"
  echo "DOCKER_HOST=unix://$socket"
}

stop() {
  local pid
  if ! pid=$(running_pid); then
    say "not running"
    return 0
  fi
  kill -TERM "$pid"
  local deadline=$((SECONDS + 90))  # dockerd stops its containers first (their grace time)
  while kill -0 "$pid" 2>/dev/null; do
    if ((SECONDS > deadline)); then
      say "dockerd (pid $pid) still running after 90 s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.2
  done
  rm -f "$pidfile"
  ip link delete "$bridge" 2>/dev/null || true
  say "stopped dockerd (pid $pid)"
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  host) echo "DOCKER_HOST=unix://$socket" ;;
  *) die "usage: $0 start|stop|host" ;;
esac

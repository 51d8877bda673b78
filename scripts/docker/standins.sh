#!/usr/bin/env bash
# Makes the public images the project's Dockerfile and compose stack start from available
# to the Docker engine at $DOCKER_HOST, for machines that cannot reach the image registry:
#
#   scripts/docker/standins.sh IMAGE...
#
# For each IMAGE: present already -> nothing; else `docker pull`; when that fails, a stand-in
# is built from Debian bookworm's packages and tagged with IMAGE's own name, and the script
# says so. The project's files keep the real names; only this engine's tags are stand-ins.
#   python:3.11-slim-bookworm      debootstrap --variant=minbase + python3, python3-venv,
#                                  python-is-python3, ca-certificates, libpython3.11-dev,
#                                  imported as an image
#   redis:*                        + redis-server      (scripts/docker/standins.Dockerfile)
#   oliver006/redis_exporter:*     + prometheus-redis-exporter
#   prom/prometheus:*              + prometheus
# Anything else (grafana/grafana-oss, vllm/vllm-openai: no Debian package) is reported as
# unavailable and the script exits 1.
#
# A machine that intercepts TLS needs its trusted CA certificates and package-manager
# configuration inside images, or apt and pip fail in them: the base gets this host's
# /usr/local/share/ca-certificates, its local apt configuration (apt.conf.d files no package
# owns, sources, keyrings), /etc/pip.conf, /etc/xdg/pip, and the PIP_* and proxy variables
# of this environment, read at build time. Stand-ins carry a label with a digest of their
# recipe (RECIPE, standins.Dockerfile) and of that configuration: one built from other
# inputs is rebuilt.
# The debootstrap tree is cached as a tarball in $LMCACHE_SVC_DOCKER_CACHE/standins (default
# /var/cache/lmcache-svc-docker); without the cache it is made again (5 minutes here).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache_dir=${LMCACHE_SVC_DOCKER_CACHE:-/var/cache/lmcache-svc-docker}/standins
docker=${DOCKER:-$(command -v /usr/bin/docker || command -v docker)}
# Change RECIPE when build_base changes what goes into the base: stand-ins built by an
# older recipe are then rebuilt (a new base invalidates every image's layer cache).
RECIPE=1
suite=bookworm
# libpython3.11-dev: Python.h, as the real image has it (torch's inductor compiles against it).
packages=python3,python3-venv,python-is-python3,ca-certificates,libpython3.11-dev
label=org.lmcache-svc.standin

say() { echo "standins: $*" >&2; }

apt_mirror() {  # the host's Debian mirror (deb822 or one-line sources), else Debian's own
  local uri
  uri=$(grep -hsE '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' \
    | grep -v security | head -n1 || true)
  [[ -n $uri ]] || uri=$(grep -hsE '^deb ' /etc/apt/sources.list | awk '{print $2}' | head -n1 || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

local_apt_conf() {  # apt.conf.d files that no package owns: this machine's own settings
  local f
  for f in /etc/apt/apt.conf.d/*; do
    [[ -f $f ]] || continue
    dpkg -S "$f" >/dev/null 2>&1 || echo "$f"
  done
}

host_env() {  # the variables pip and apt need here, as KEY=VALUE lines
  env | grep -E '^(PIP_[A-Z_]+|https?_proxy|no_proxy|HTTPS?_PROXY|NO_PROXY)=' | sort || true
}

host_files() {  # the configuration files copied into the base
  local_apt_conf
  ls -d /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources \
    /etc/apt/keyrings/* /etc/apt/trusted.gpg.d/* /usr/local/share/ca-certificates/* \
    /etc/pip.conf /etc/xdg/pip/* 2>/dev/null || true
}

config_digest() {  # what the images are made of (not this script's wording: see RECIPE)
  {
    cat "$here/standins.Dockerfile"
    echo "$RECIPE $suite $packages $(apt_mirror)"
    host_env
    host_files | while read -r f; do echo "$f"; cat "$f"; done
  } | sha256sum | cut -c1-16
}

standin_key() { "$docker" image inspect -f "{{index .Config.Labels \"$label\"}}" "$1" 2>/dev/null || true; }

rootfs_tar() {  # debootstrap once per suite/packages/mirror; prints the tarball's path
  local key tar tmp
  key=$(echo "$suite $packages $(apt_mirror)" | sha256sum | cut -c1-16)
  tar=$cache_dir/debian-$suite-python-$key.tar
  if [[ ! -f $tar ]]; then
    command -v debootstrap >/dev/null || { say "debootstrap is missing (scripts/setup_ops.sh)"; exit 1; }
    mkdir -p "$cache_dir"
    tmp=$(mktemp -d "$cache_dir/rootfs.XXXXXX")
    say "debootstrap --variant=minbase $suite from $(apt_mirror) (cached in $tar)"
    debootstrap --variant=minbase --include="$packages" "$suite" "$tmp/rootfs" "$(apt_mirror)" \
      >"$tmp/debootstrap.log" 2>&1 || { tail -n 20 "$tmp/debootstrap.log" >&2; exit 1; }
    tar -C "$tmp/rootfs" --numeric-owner -cf "$tar.part" .
    rm -f "$cache_dir/debian-$suite-python-"*.tar  # other recipes' trees
    mv "$tar.part" "$tar"
    rm -rf "$tmp"
  fi
  echo "$tar"
}

build_base() {  # $1 = name to tag, $2 = digest
  local tar tmp f changes=()
  tar=$(rootfs_tar)
  tmp=$(mktemp -d "$cache_dir/base.XXXXXX")
  mkdir "$tmp/rootfs"
  tar -C "$tmp/rootfs" --numeric-owner -xf "$tar"
  # This host's configuration, so that apt and pip inside images reach the registries.
  rm -f "$tmp/rootfs/etc/apt/sources.list"
  while read -r f; do
    mkdir -p "$tmp/rootfs$(dirname "$f")"
    cp -L "$f" "$tmp/rootfs$f"
  done < <(host_files)
  [[ -f $tmp/rootfs/etc/apt/sources.list || -n $(ls "$tmp/rootfs/etc/apt/sources.list.d" 2>/dev/null) ]] \
    || echo "deb $(apt_mirror) $suite main" >"$tmp/rootfs/etc/apt/sources.list"
  chroot "$tmp/rootfs" update-ca-certificates >/dev/null 2>&1
  # As Debian's own images do: no service starts when a package is installed; no apt lists.
  printf '#!/bin/sh\nexit 101\n' >"$tmp/rootfs/usr/sbin/policy-rc.d"
  chmod 755 "$tmp/rootfs/usr/sbin/policy-rc.d"
  rm -rf "$tmp/rootfs/var/lib/apt/lists/"* "$tmp/rootfs/var/cache/apt/"*.bin
  while IFS= read -r line; do changes+=(--change "ENV $line"); done < <(host_env)
  tar -C "$tmp/rootfs" --numeric-owner -c . | "$docker" import \
    "${changes[@]}" \
    --change "LABEL $label=$2" \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$1" >/dev/null
  rm -rf "$tmp"
}

build_target() {  # $1 = name to tag, $2 = stand-in target, $3 = digest, $4 = base
  DOCKER_BUILDKIT=1 "$docker" build -q -f "$here/standins.Dockerfile" --target "$2" \
    --build-arg "BASE=$4" --label "$label=$3" -t "$1" "$here" >/dev/null
}

digest=$(config_digest)
base=python:3.11-slim-bookworm
missing=0
declare -A seen=()
ensure() {  # $1 = image
  local image=$1 target started
  [[ -z ${seen[$image]:-} ]] || return 0
  seen[$image]=1
  case $image in
    python:3.11-slim-bookworm) target=base ;;
    redis:*) target=redis ;;
    oliver006/redis_exporter:*) target=redis-exporter ;;
    prom/prometheus:*) target=prometheus ;;
    *) target="" ;;
  esac
  local key
  key=$(standin_key "$image")
  if "$docker" image inspect "$image" >/dev/null 2>&1 && [[ -z $key || $key == "$digest" ]]; then
    if [[ -n $key ]]; then say "$image: stand-in from Debian packages (built earlier, $key)"; fi
    return 0
  fi
  if [[ -z $key ]] && "$docker" pull -q "$image" >/dev/null 2>&1; then
    say "$image: pulled"
    return 0
  fi
  if [[ -z $target ]]; then
    say "$image: cannot be pulled and has no stand-in (no Debian package)"
    missing=1
    return 0
  fi
  [[ $target == base || $image == "$base" ]] || ensure "$base"
  started=$SECONDS
  if [[ $target == base ]]; then
    build_base "$image" "$digest"
  else
    build_target "$image" "$target" "$digest" "$base"
  fi
  say "$image: the registry is unreachable: stand-in built from Debian $suite packages" \
    "($target, $((SECONDS - started)) s)"
}

for image in "$@"; do ensure "$image"; done
exit "$missing"

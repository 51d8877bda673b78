# Shared steps of setup_vllm.sh and setup_lmcache.sh (sourced; expects $venv and log()).
#   venv_create            create $venv from $PYTHON (default python3.11, else python3)
#   pip_ ARGS...           pip in $venv, without this machine's extra-index noise
#   fetch_wheel SPEC GLOB  download SPEC without deps into $venv/.wheels once; prints the path
#   wheel_requirements WHEEL OUT [--skip ...] [--pin NAME=SPEC ...]   (see wheel_requirements.py)

lib_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

venv_create() {
  local py=${PYTHON:-$(command -v python3.11 || command -v python3)}
  if [[ ! -x $venv/bin/python ]]; then
    log "creating $venv with $py"
    "$py" -m venv "$venv"
  fi
}

pip_() {
  "$venv/bin/python" -m pip --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}

fetch_wheel() {
  local spec=$1 glob=$2 wheel_dir=$venv/.wheels wheel
  mkdir -p "$wheel_dir"
  wheel=$(ls "$wheel_dir"/$glob 2>/dev/null | head -n1 || true)
  if [[ -z $wheel ]]; then
    log "downloading $spec (no deps)"
    pip_ download -q --no-deps "$spec" -d "$wheel_dir"
    wheel=$(ls "$wheel_dir"/$glob | head -n1)
  fi
  echo "$wheel"
}

wheel_requirements() {
  "$venv/bin/python" "$lib_dir/wheel_requirements.py" "$@"
}

# What the stamp of a venv built with these steps must cover besides the caller's own files.
lib_files() {
  echo "$lib_dir/wheel_venv.sh" "$lib_dir/wheel_requirements.py"
}

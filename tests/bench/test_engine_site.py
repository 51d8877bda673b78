"""The engines' ``sitecustomize`` (``benchmarks/lmcache_svc_bench/vllm/site``): a Python
process started with it on ``PYTHONPATH`` holds the AMX tile permission, which vLLM's CPU
attention needs on an AMX host (without it a short first prompt kills the worker with
SIGILL; seen on this project's CI host)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_svc_bench.vllm.engines import SITE

XFEATURE_XTILEDATA = 18
# Prints the process's permitted dynamic xstate features (arch_prctl ARCH_GET_XCOMP_PERM).
PRINT_PERMISSION = (
    "import ctypes\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "mask = ctypes.c_uint64(0)\n"
    "rc = libc.syscall(158, 0x1022, ctypes.byref(mask))\n"
    "print(rc, mask.value)\n"
)


def _has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_tile" in flags


def _permission(with_site: bool) -> int:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if with_site:
        env["PYTHONPATH"] = str(SITE)
    done = subprocess.run(
        [sys.executable, "-c", PRINT_PERMISSION], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    rc, mask = (int(x) for x in done.stdout.split())
    assert rc == 0, "arch_prctl(ARCH_GET_XCOMP_PERM) failed"
    return mask


@pytest.mark.skipif(
    sys.platform != "linux" or not _has_amx(), reason="needs an x86-64 Linux host with AMX"
)
def test_an_engine_process_holds_the_amx_permission() -> None:
    assert not _permission(with_site=False) & (1 << XFEATURE_XTILEDATA)  # not by default
    assert _permission(with_site=True) & (1 << XFEATURE_XTILEDATA)


def test_the_site_module_imports_anywhere() -> None:
    """On any host (AMX or not) the module imports cleanly: a failed request is ignored."""
    env = {**os.environ, "PYTHONPATH": str(SITE)}
    done = subprocess.run(
        [sys.executable, "-c", "import sitecustomize; print(sitecustomize.__file__)"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(SITE / "sitecustomize.py")

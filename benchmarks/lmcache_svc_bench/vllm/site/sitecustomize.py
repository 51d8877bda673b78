"""Run at the start of every Python process of the engines the benchmarks and tests start
(their ``PYTHONPATH`` holds this folder): asks Linux for the AMX tile state.

On an x86 host with AMX (Intel Sapphire Rapids and later), a process may execute AMX
instructions only after asking the kernel (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``); without it they raise SIGILL. vLLM 0.32's CPU attention kernel
uses AMX for bf16 but does not ask: oneDNN asks when it first picks an AMX matmul (a long
prompt's prefill), so an engine whose first request is a few tokens long loses its worker
to an illegal instruction (measured on this project's CI host: plain vLLM, no connector, a
4-token first prompt). The permission does not survive ``exec``, and vLLM starts its engine
core and workers with ``spawn``, so every process asks for itself. On other hosts the call
fails harmlessly and nothing changes.
"""

from __future__ import annotations

import ctypes
import platform
import sys

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def _request_amx() -> None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    except (OSError, AttributeError):  # no libc syscall(): nothing to ask
        pass


_request_amx()

"""Keeping the plugin's worker threads off the forward pass's cores.

vLLM's CPU backend binds every thread of a worker process to its compute cores (measured
in 0.32 on a 2-core host: all threads of the worker on core 0, the engine core process on
0-1) and leaves the reserved cores (``VLLM_CPU_NUM_OF_RESERVED_CPU``) to everything else.
A new thread inherits its creator's binding, so without this the plugin's I/O threads
(slot reservations, commits, releases) would take CPU from the forward pass while the
reserved cores idle. ``off_compute_cores``, a thread pool initializer, moves the calling
thread to the host's other cores when there are any; on an unbound process (GPU workers)
it changes nothing.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(f"vllm.{__name__}")


def off_compute_cores() -> None:
    """Bind the calling thread to the cores its creator is not bound to, if any."""
    if not hasattr(os, "sched_setaffinity"):
        return
    bound = os.sched_getaffinity(0)  # 0: the calling thread (its inherited binding)
    others = set(range(os.cpu_count() or 1)) - bound
    if not others:
        return
    try:
        os.sched_setaffinity(0, others)
    except OSError as e:  # a cpuset that excludes the other cores: stay where we are
        logger.debug("lmcache-svc: thread stays on cores %s: %s", sorted(bound), e)

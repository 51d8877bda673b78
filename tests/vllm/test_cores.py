"""Plugin threads leave the cores their creator is bound to (vLLM's CPU worker binds every
thread to the forward pass's cores)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from lmcache_svc_vllm.cores import off_compute_cores

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs thread affinity and at least two usable cores",
)


def _pool_thread_cores(creator_cores: set[int]) -> tuple[set[int], set[int]]:
    """(creator's cores after, pool thread's cores) for a pool made by a thread bound to
    ``creator_cores``."""
    out: dict[str, set[int]] = {}

    def creator() -> None:
        os.sched_setaffinity(0, creator_cores)  # like vLLM's binding of the worker
        with ThreadPoolExecutor(1, initializer=off_compute_cores) as pool:
            out["pool"] = pool.submit(os.sched_getaffinity, 0).result()
        out["creator"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=creator)
    thread.start()
    thread.join()
    return out["creator"], out["pool"]


def test_a_pool_thread_runs_on_the_other_cores() -> None:
    usable = os.sched_getaffinity(0)
    compute = {min(usable)}
    creator, pool = _pool_thread_cores(compute)
    assert creator == compute  # the creator keeps its binding
    assert pool == set(range(os.cpu_count() or 1)) - compute


def test_an_unbound_creator_changes_nothing() -> None:
    everything = set(range(os.cpu_count() or 1))
    if os.sched_getaffinity(0) != everything:
        pytest.skip("this process is not allowed every core")
    assert _pool_thread_cores(everything) == (everything, everything)

"""Slot calls run on the gRPC event loop only when no tier may block (capability, not count)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.values import TierPolicy
from lmcache_svc.server.grpc.cache_service import CacheServicer
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.base import Tier
from lmcache_svc.tiers.cpu import CpuTier
from lmcache_svc.tiers.ssd import SsdTier


def _cpu() -> CpuTier:
    return CpuTier(Arena.create(1 << 20, slab_bytes=64 << 10, prefault="off"), name="cpu")


@pytest.fixture
def servicer_with(tmp_path: Path) -> Iterator:
    made: list[tuple[TieredCache, CacheServicer]] = []

    def make(*lower: Tier) -> CacheServicer:
        cache = TieredCache(_cpu(), [(t, TierPolicy()) for t in lower])
        servicer = CacheServicer(cache, max_body_bytes=1 << 20, workers=1)
        made.append((cache, servicer))
        return servicer

    yield make
    for cache, servicer in made:
        servicer.close()
        cache.close()


def _thread_of_a_slot_call(servicer: CacheServicer) -> str:
    async def call() -> str:
        thread = await servicer._slots(threading.current_thread, arena_only=True)
        return thread.name

    return asyncio.run(call())


def test_slot_calls_run_inline_with_the_cpu_tier_alone(servicer_with) -> None:
    assert _thread_of_a_slot_call(servicer_with()) == threading.current_thread().name


def test_a_lower_tier_on_disk_moves_slot_calls_off_the_event_loop(
    servicer_with, tmp_path: Path
) -> None:
    servicer = servicer_with(SsdTier(tmp_path / "ssd", 1 << 20))
    assert _thread_of_a_slot_call(servicer).startswith("lmcache-svc-arena")


def test_a_lower_tier_in_memory_keeps_slot_calls_inline(servicer_with) -> None:
    """Two tiers, neither of which may block: the count of tiers does not decide."""
    lower = CpuTier(Arena.create(1 << 20, slab_bytes=64 << 10, prefault="off"), name="cpu2")
    assert _thread_of_a_slot_call(servicer_with(lower)) == threading.current_thread().name

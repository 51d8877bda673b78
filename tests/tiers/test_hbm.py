"""The HBM tier on its CPU allocator seam: slots, capacity, pinned reads, its place in the
cache's policy (demotion from the arena, LRU down to SSD, promotion back); config errors
without CUDA. The device copies and CUDA IPC run in tests/gpu (GPU machines only)."""

# ruff: noqa: E402  (imports after the torch check)
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the HBM tier needs torch (the [torch] extra)")
import torch

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.values import TierPolicy
from lmcache_svc.config import load_config
from lmcache_svc.errors import ConfigError, InvalidArgument
from lmcache_svc.server.app import build_cache
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.cpu import CpuTier
from lmcache_svc.tiers.cuda_ipc import CudaIpcHandle, export_handle
from lmcache_svc.tiers.hbm import DevicePool, HbmTier
from lmcache_svc.tiers.ssd import SsdTier
from tests.cuda_marks import cuda_available
from tests.helpers import make_chunk, make_hash, make_key, make_namespace

CHUNK = 64 * 1024


# The pool on a CPU tensor everywhere; on a CUDA device too where there is one.
DEVICES = ["cpu", *(["cuda"] if cuda_available() else [])]


def make_tier(num_chunks: int, device: str = "cpu") -> tuple[HbmTier, torch.Tensor]:
    buffer = torch.zeros(num_chunks * CHUNK, dtype=torch.uint8, device=device)
    return HbmTier(DevicePool(buffer), slab_bytes=CHUNK), buffer


@pytest.mark.parametrize("device", DEVICES)
def test_chunks_live_at_their_slot_in_the_pool(device: str) -> None:
    tier, buffer = make_tier(4, device)
    assert tier.put(make_key(1), make_chunk("a", CHUNK)) and tier.put(
        make_key(2), make_chunk("b", CHUNK)
    )
    slot = tier.slot_of(make_key(2))
    assert slot is not None and slot.length == CHUNK
    pool_bytes = bytes(buffer[slot.offset : slot.offset + slot.length].cpu().numpy())
    assert pool_bytes == make_chunk("b", CHUNK)  # what an engine mapping the pool would copy
    assert tier.slot_of(make_key(3)) is None
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.export_handle()


def test_a_slot_being_read_is_not_reused_until_the_read_ends() -> None:
    tier, _ = make_tier(1)
    tier.put(make_key(1), make_chunk("a", CHUNK))
    slot = tier.slot_of(make_key(1))
    assert slot is not None
    with tier._lock:
        tier._reads.begin(slot)  # a read_into in flight, as read_into counts it
    assert tier.delete(make_key(1)) == CHUNK
    assert not tier.put(make_key(2), make_chunk("b", CHUNK))  # the slot is still being read
    tier._end_read(slot)
    assert tier.put(make_key(2), make_chunk("b", CHUNK))
    assert tier.get(make_key(2)) == make_chunk("b", CHUNK)


def test_empty_chunks_and_wrong_buffers_are_refused() -> None:
    tier, _ = make_tier(2)
    with pytest.raises(InvalidArgument):
        tier.put(make_key(1), b"")
    tier.put(make_key(1), make_chunk("a", CHUNK))
    with pytest.raises(InvalidArgument):
        tier.read_into(make_key(1), memoryview(bytearray(CHUNK + 1)))
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        DevicePool(torch.zeros(4, 4, dtype=torch.uint8))


# -- in the cache's policy -------------------------------------------------------------


NAMESPACE = make_namespace(chunk_size=256)  # 64 KiB chunks
NS = NAMESPACE.namespace_id


@pytest.fixture(params=DEVICES)
def cache(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[TieredCache]:
    arena = Arena.create(2 * CHUNK, slab_bytes=CHUNK, prefault="off")
    hbm, _ = make_tier(3, request.param)
    ssd = SsdTier(tmp_path / "ssd", 8 * (CHUNK + 4096))
    made = TieredCache(CpuTier(arena), [(hbm, TierPolicy()), (ssd, TierPolicy())])
    made.register_namespace(NAMESPACE)
    yield made
    made.close()


def where(cache: TieredCache, *names: str) -> list[str | None]:
    return [cache.contains(NS, make_hash(n)) for n in names]


def test_arena_evictions_go_to_hbm_and_its_lru_goes_on_to_ssd(cache: TieredCache) -> None:
    for n in "abcdef":
        assert cache.put(NS, make_hash(n), make_chunk(n, CHUNK)) == "reserved"
    # arena holds 2, HBM 3: a, b, c, d were demoted to HBM in that order, d pushed a on
    assert where(cache, *"abcdef") == ["ssd", "hbm", "hbm", "hbm", "cpu", "cpu"]
    hbm = cache.tiers[1]
    assert hbm.used_bytes <= hbm.capacity_bytes and hbm.num_chunks == 3
    assert cache.metrics.demotions.labels(tier="hbm")._value.get() == 4
    assert cache.metrics.demotions.labels(tier="ssd")._value.get() == 1


def test_a_load_promotes_from_hbm_into_the_arena(cache: TieredCache) -> None:
    for n in "abcd":
        cache.put(NS, make_hash(n), make_chunk(n, CHUNK))
    assert where(cache, "a", "b") == ["hbm", "hbm"]
    lease = cache.prepare_load(NS, [make_hash("a")])
    assert lease.source_tiers == ["hbm"]
    assert bytes(cache.view(lease.slots[0])) == make_chunk("a", CHUNK)
    assert lease.lease_id is not None and cache.release_load(lease.lease_id)
    assert where(cache, "a")[0] == "cpu"
    assert cache.metrics.promotions.labels(tier="cpu")._value.get() == 1


# -- configuration -----------------------------------------------------------------------


def test_the_hbm_tier_is_off_by_default() -> None:
    config = load_config(env={})
    assert config.hbm.capacity is None


def test_enabling_hbm_where_it_cannot_run_names_the_setting(tmp_path: Path) -> None:
    # no CUDA here: "CUDA is not available"; on a GPU machine device 4095 does not exist
    config = load_config(
        env={},
        overrides={"hbm.capacity": "64MiB", "hbm.device": 4095, "socket": str(tmp_path / "s")},
    )
    with pytest.raises(ConfigError, match=r"hbm\.(capacity|device)") as info:
        build_cache(config)
    if not torch.cuda.is_available():
        assert "CUDA is not available" in str(info.value)


def test_ipc_handle_fields_round_trip_through_protobuf() -> None:
    handle = CudaIpcHandle(1, b"\x01" * 64, 1 << 30, 4096, b"/torch_123", 8, b"\x02" * 64, True)
    wire = handle.to_proto().SerializeToString()
    from lmcache_svc.v1 import device_pb2

    assert CudaIpcHandle.from_proto(device_pb2.CudaIpcHandle.FromString(wire)) == handle


def test_only_cuda_memory_exports_a_handle() -> None:
    with pytest.raises(ValueError, match="only CUDA memory"):
        export_handle(torch.zeros(16, dtype=torch.uint8))

"""The GPU paths on a real device (skipped without CUDA, with the one shared reason):
the two-process checks of ``check.py`` at their small sizes, and real page-locking."""

from __future__ import annotations

import mmap

import pytest

from tests.cuda_marks import requires_cuda

pytestmark = requires_cuda


def test_arena_round_trip_in_vllm_cuda_layout_across_two_processes() -> None:
    from tests.gpu.check import check_arena_round_trip

    check_arena_round_trip()


def test_hbm_tier_over_cuda_ipc_across_two_processes() -> None:
    from tests.gpu.check import check_hbm_ipc

    check_hbm_ipc()


@pytest.mark.parametrize("read_only", [False, True])
def test_a_mapping_is_page_locked_and_unlocked(read_only: bool) -> None:
    import torch
    from lmcache_svc_vllm.pinning import HostPinner, address_of, cuda_host_registrar

    from tests.gpu.check import REPO  # noqa: F401  (puts the plugin on sys.path)

    size = 64 << 20
    mm = mmap.mmap(-1, size, prot=mmap.PROT_READ if read_only else mmap.PROT_READ | mmap.PROT_WRITE)
    view = memoryview(mm)
    pinner = HostPinner(*cuda_host_registrar(), part_bytes=16 << 20)
    assert pinner.add_buffer(view[4096:8192])
    assert pinner.wait_idle(60)
    assert pinner.is_pinned(address_of(mm), size), "cudaHostRegister failed (see the log)"
    host = torch.frombuffer(mm, dtype=torch.uint8) if not read_only else None
    if host is not None:
        dev = torch.arange(size, device="cuda").to(torch.uint8)
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(host[:1000], dev[:1000].cpu())
        del host
    pinner.close()
    assert pinner.registered == []
    view.release()
    mm.close()


@pytest.mark.parametrize("neighbour", ["registered", "pageable"])
def test_a_slot_straddling_two_parts_copies_correctly(neighbour: str) -> None:
    """HostPinner registers a mapping part by part, so a slot can span two registrations,
    or (while the background thread is still at work) a registered part and a pageable one."""
    import torch
    from lmcache_svc_vllm.pinning import HostPinner, address_of, cuda_host_registrar

    from tests.gpu.check import REPO  # noqa: F401  (puts the plugin on sys.path)

    part, slot_bytes = 16 << 20, 2 << 20
    mm = mmap.mmap(-1, 4 * part)
    pinner = HostPinner(*cuda_host_registrar(), part_bytes=part)
    assert pinner.add_range(address_of(mm), 2 * part, read_only=False)  # parts 0 and 1
    assert pinner.wait_idle(60) and len(pinner.registered) == 2
    boundary = part if neighbour == "registered" else 2 * part
    start = boundary - slot_bytes // 2
    assert pinner.is_pinned(address_of(mm) + start, slot_bytes) == (neighbour == "registered")
    host = torch.frombuffer(mm, dtype=torch.uint8)[start : start + slot_bytes]
    dev = torch.randint(0, 256, (slot_bytes,), dtype=torch.uint8, device="cuda")
    host.copy_(dev, non_blocking=True)  # device to host
    torch.cuda.synchronize()
    assert torch.equal(host, dev.cpu())
    back = torch.zeros_like(dev)
    back.copy_(host, non_blocking=True)  # host to device
    torch.cuda.synchronize()
    assert torch.equal(back, dev)
    del host
    pinner.close()
    assert pinner.registered == []
    mm.close()

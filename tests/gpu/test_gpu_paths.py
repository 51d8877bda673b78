"""The GPU paths on a real device (skipped without CUDA, with the one shared reason):
the two-process checks of ``check.py`` at their small sizes, and real page-locking."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable

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
    pinner = HostPinner(*cuda_host_registrar())  # whole: a copy may span the mapping
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


def test_copies_through_any_slot_of_a_registered_mapping() -> None:
    """HostPinner registers a mapping whole: slots at any offset, those across what used to
    be a part boundary included, copy both ways (a copy across two registrations fails with
    cudaErrorInvalidValue: check.py's probe_straddling shows it)."""
    import torch
    from lmcache_svc_vllm.pinning import HostPinner, address_of, cuda_host_registrar

    size, slot_bytes = 64 << 20, 2 << 20
    mm = mmap.mmap(-1, size)
    pinner = HostPinner(*cuda_host_registrar())
    assert pinner.add_range(address_of(mm), size, read_only=False)
    assert pinner.wait_idle(60) and len(pinner.registered) == 1
    host_all = torch.frombuffer(mm, dtype=torch.uint8)
    dev = torch.randint(0, 256, (slot_bytes,), dtype=torch.uint8, device="cuda")
    for start in (0, (16 << 20) - (1 << 20), (32 << 20) - 4096, size - slot_bytes):
        host = host_all[start : start + slot_bytes]
        host.copy_(dev, non_blocking=True)  # device to host
        torch.cuda.synchronize()
        assert torch.equal(host, dev.cpu()), start
        back = torch.zeros_like(dev)
        back.copy_(host, non_blocking=True)  # host to device
        torch.cuda.synchronize()
        assert torch.equal(back, dev), start
        dev = dev.roll(1)
    del host, host_all
    pinner.close()
    assert pinner.registered == []
    mm.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["side-stream", "one-stream"])
def test_grouped_copies_of_many_units_round_trip(
    monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """Saves and loads of whole chunks in several units (2 groups of 4 layers x 2 batches
    of 2 chunks), the units taking turns with two scratch buffers while the copies run
    beside the gathers and scatters (one stream: one buffer, 2 units of 4 chunks), between
    page-locked slots and scattered blocks."""
    import torch
    from lmcache_svc_vllm import mover as mover_module
    from lmcache_svc_vllm.mover import ChunkLoad, ChunkSave, PageMover
    from lmcache_svc_vllm.streams import CudaCopyStream

    from tests.gpu.check import LOADED, SAVED, make_pages

    src, dst = make_pages(seed=11), make_pages(seed=12)
    g = src.geometry
    monkeypatch.setattr(mover_module, "SCRATCH_BYTES", 2 * g.chunk_bytes)  # 2 x 2 groups
    slots = torch.empty((len(SAVED), g.chunk_bytes), dtype=torch.uint8, pin_memory=True)
    chunks = [slot.view(g.num_layers, g.blocks_per_chunk, g.page_bytes) for slot in slots]
    stream = CudaCopyStream("cuda")
    mover = PageMover(src, stream, overlap=overlap, unit_bytes=0)
    assert len(mover._units(len(SAVED), range(g.num_layers))) == (4 if overlap else 2)
    mover.save([ChunkSave(ids, c) for ids, c in zip(SAVED, chunks)]).synchronize()
    for ids, chunk in zip(SAVED, chunks):
        index = torch.tensor(ids, device="cuda")
        want = torch.stack([layer.index_select(0, index) for layer in src.layers])
        assert torch.equal(chunk.cuda(), want)
    loads = [ChunkLoad(c, 0, ids) for c, ids in zip(chunks, LOADED)]
    PageMover(dst, stream, overlap=overlap, unit_bytes=0).load(loads).synchronize()
    for s_layer, d_layer in zip(src.layers, dst.layers):
        for saved, loaded in zip(SAVED, LOADED):
            assert torch.equal(d_layer[loaded], s_layer[saved])


def test_a_replaced_mapping_is_unregistered_on_the_device(caplog: pytest.LogCaptureFixture) -> None:
    """A server restart, as the worker sees it: the buffers of a new mapping retire the
    old one, which the driver then really lets go (registering it again succeeds; a range
    still registered fails with cudaErrorHostMemoryAlreadyRegistered), and copies into the
    new one run."""
    import torch
    from lmcache_svc_vllm.pinning import HostPinner, address_of, cuda_drain, cuda_host_registrar

    size = 64 << 20
    old, new = mmap.mmap(-1, size), mmap.mmap(-1, size)
    register, unregister = cuda_host_registrar()
    pinner = HostPinner(register, unregister, drain=cuda_drain(torch.device("cuda")))
    assert pinner.add_buffer(memoryview(old)[:4096])
    assert pinner.wait_idle(60) and pinner.is_pinned(address_of(old), size)
    assert not registers_again(register, address_of(old), size)  # registered: refused
    assert pinner.add_buffer(memoryview(new)[:4096])
    assert pinner.wait_idle(60)
    assert [p.address for p in pinner.registered] == [address_of(new)]
    assert registers_again(register, address_of(old), size)  # the driver let it go
    unregister(address_of(old))
    host = torch.frombuffer(new, dtype=torch.uint8)
    dev = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host, dev.cpu())
    del host
    pinner.close()
    assert pinner.registered == []
    assert "failed" not in caplog.text
    old.close()
    new.close()


def registers_again(register: Callable[[int, int, bool], None], address: int, size: int) -> bool:
    """Whether ``cudaHostRegister`` takes the range, tried on a thread of its own: a
    failure leaves the CUDA runtime's last error set in the calling thread, where torch's
    next launch check would raise it."""
    ok: list[bool] = []

    def run() -> None:
        try:
            register(address, size, False)
            ok.append(True)
        except RuntimeError:
            ok.append(False)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    return ok == [True]

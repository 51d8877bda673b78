"""The page-locking scheduler's bookkeeping, with recording register functions (the real
``cudaHostRegister`` runs only on a GPU machine: tests/gpu)."""

# ruff: noqa: E402  (imports after the torch check)
from __future__ import annotations

import gc
import mmap
import threading
import weakref

import pytest

pytest.importorskip("torch", reason="the plugin needs torch (the [torch] extra)")
from lmcache_svc_vllm import pinning
from lmcache_svc_vllm.pinning import HostPinner, Part, address_of

from tests.helpers import wait_until

MiB = 1 << 20


class Recorder:
    def __init__(
        self, *, fail_at: frozenset[int] = frozenset(), gate: threading.Event | None = None
    ):
        self.registered: list[tuple[int, int, bool]] = []
        self.unregistered: list[int] = []
        self.fail_at = fail_at
        self.gate = gate

    def register(self, address: int, nbytes: int, read_only: bool) -> None:
        if self.gate is not None:
            assert self.gate.wait(10)
        if address in self.fail_at:
            raise RuntimeError("cudaHostRegister failed with CUDA error 1")
        self.registered.append((address, nbytes, read_only))

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


def test_a_mapping_is_registered_in_parts_in_address_order_then_unregistered() -> None:
    rec = Recorder()
    pinner = HostPinner(rec.register, rec.unregister, part_bytes=4 * MiB)
    assert pinner.add_range(1 << 40, 10 * MiB, read_only=False)
    assert not pinner.add_range(1 << 40, 10 * MiB, read_only=False)  # known: once only
    assert pinner.wait_idle(10)
    base = 1 << 40
    assert rec.registered == [
        (base, 4 * MiB, False),
        (base + 4 * MiB, 4 * MiB, False),
        (base + 8 * MiB, 2 * MiB, False),
    ]
    assert pinner.is_pinned(base + 3 * MiB, 6 * MiB)  # spans two parts
    assert not pinner.is_pinned(base + 9 * MiB, 2 * MiB)  # runs past the mapping
    pinner.close()
    assert sorted(rec.unregistered) == [base, base + 4 * MiB, base + 8 * MiB]
    assert pinner.registered == []


def test_registration_never_blocks_the_caller_and_unregistered_parts_read_as_pageable() -> None:
    gate = threading.Event()
    rec = Recorder(gate=gate)
    pinner = HostPinner(rec.register, rec.unregister, part_bytes=4 * MiB)
    pinner.add_range(1 << 40, 8 * MiB, read_only=True)  # returns while register is stuck
    assert not pinner.is_pinned(1 << 40, 4096)
    gate.set()
    assert pinner.wait_idle(10)
    assert pinner.is_pinned(1 << 40, 8 * MiB)
    assert all(ro for _, _, ro in rec.registered)
    pinner.close()


def test_a_failed_part_stays_pageable_and_is_not_unregistered() -> None:
    base = 1 << 40
    rec = Recorder(fail_at=frozenset({base + 4 * MiB}))
    pinner = HostPinner(rec.register, rec.unregister, part_bytes=4 * MiB)
    pinner.add_range(base, 12 * MiB, read_only=False)
    assert pinner.wait_idle(10)
    assert pinner.registered == [Part(base, 4 * MiB, False), Part(base + 8 * MiB, 4 * MiB, False)]
    assert not pinner.is_pinned(base, 8 * MiB)
    pinner.close()
    assert sorted(rec.unregistered) == [base, base + 8 * MiB]


def test_close_stops_pending_parts() -> None:
    gate = threading.Event()
    rec = Recorder(gate=gate)
    pinner = HostPinner(rec.register, rec.unregister, part_bytes=4096)
    pinner.add_range(1 << 40, 4096 * 100, read_only=False)
    closer = threading.Thread(target=pinner.close)
    closer.start()
    # The gate opens only once close() has run: before, the worker could register several
    # parts between the gate and the close (3 of them in one run).
    wait_until(lambda: pinner.closed, 10, "close() to begin")
    gate.set()
    closer.join(10)
    assert not closer.is_alive()
    assert len(rec.registered) <= 1  # at most the part in flight when close came
    assert sorted(rec.unregistered) == [a for a, _, _ in rec.registered]
    assert not pinner.add_range(1 << 41, 4096, read_only=False)


def test_slot_buffers_name_their_mapping_once_per_mapping(tmp_path: object) -> None:
    size = 3 * 4096
    rw = mmap.mmap(-1, size)
    rec = Recorder()
    pinner = HostPinner(rec.register, rec.unregister, part_bytes=4096)
    view = memoryview(rw)
    assert pinner.add_buffer(view[4096:8192])
    assert not pinner.add_buffer(view[8192:])  # same mapping
    assert pinner.wait_idle(10)
    base = address_of(rw)
    assert [a for a, _, _ in rec.registered] == [base, base + 4096, base + 8192]
    pinner.close()
    view.release()
    rw.close()  # address_of kept no export of the mapping


def test_buffers_of_inline_transfers_are_never_registered() -> None:
    rec = Recorder()
    pinner = HostPinner(rec.register, rec.unregister, part_bytes=4096)
    assert not pinner.add_buffer(memoryview(bytearray(8192))[4096:])
    assert not pinner.add_buffer(memoryview(b"x" * 4096))
    pinner.close()
    assert rec.registered == []


def test_bad_part_size_is_refused() -> None:
    with pytest.raises(ValueError, match="part_bytes"):
        HostPinner(Recorder().register, Recorder().unregister, part_bytes=1000)


def test_a_mapping_is_registered_whole_by_default() -> None:
    # A copy that spans two registrations fails on a GPU (cudaErrorInvalidValue): by
    # default no slot of a mapping can lie across a registration's end.
    rec = Recorder()
    pinner = HostPinner(rec.register, rec.unregister)
    assert pinner.add_range(1 << 40, 3 * 1024 * MiB + 4096, read_only=True)
    assert pinner.wait_idle(10)
    assert rec.registered == [(1 << 40, 3 * 1024 * MiB + 4096, True)]
    pinner.close()
    assert rec.unregistered == [1 << 40]


class M(mmap.mmap):
    """An ``mmap`` a test can hold a weak reference to."""


class Log(Recorder):
    """Every register, unregister and drain, in order, in one list."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def register(self, address: int, nbytes: int, read_only: bool) -> None:
        super().register(address, nbytes, read_only)
        self.calls.append(("register", address))

    def unregister(self, address: int) -> None:
        super().unregister(address)
        self.calls.append(("unregister", address))

    def drain(self) -> None:
        self.calls.append(("drain", 0))


def test_a_newer_mapping_retires_the_older_one_of_the_same_access() -> None:
    """A server restart: the client maps the new segment, whose buffers retire the old
    mapping (drained, then unregistered); the other access's mapping stays."""
    log = Log()
    pinner = HostPinner(log.register, log.unregister, drain=log.drain)
    old_rw, old_ro, new_rw = M(-1, 8192), M(-1, 8192), M(-1, 8192)
    assert pinner.add_buffer(memoryview(old_rw)[4096:])
    assert pinner.add_buffer(memoryview(old_ro).toreadonly())
    assert pinner.wait_idle(10)
    assert pinner.add_buffer(memoryview(new_rw)[:4096])
    assert pinner.wait_idle(10)
    old, new = address_of(old_rw), address_of(new_rw)
    assert log.calls[2:] == [("drain", 0), ("unregister", old), ("register", new)]
    assert {p.address for p in pinner.registered} == {address_of(old_ro), new}
    assert not pinner.add_buffer(memoryview(new_rw))  # known
    pinner.close()
    assert sorted(log.unregistered) == sorted([old, address_of(old_ro), new])


def test_a_registered_mapping_stays_mapped_until_it_is_retired() -> None:
    """Unmapped while registered, its pages would stay locked until the engine exits: the
    pinner holds the mapping until a newer one retires it (or until close)."""
    rec = Recorder()
    pinner = HostPinner(rec.register, rec.unregister)
    first = M(-1, 8192)
    gone = weakref.ref(first)
    pinner.add_buffer(memoryview(first)[:4096])
    del first
    gc.collect()
    assert pinner.wait_idle(10)
    assert gone() is not None, "the registered mapping was let go (and unmapped)"
    second = M(-1, 8192)
    pinner.add_buffer(memoryview(second)[:4096])
    assert pinner.wait_idle(10)
    gc.collect()
    assert gone() is None, "the retired mapping is still held"
    pinner.close()


def test_a_new_mapping_at_the_old_ones_address_is_registered_after_the_unregister(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel may place the new segment where the old one was: it is registered (not
    taken for known), and only once the old registration is undone (registering a range
    twice fails)."""
    log = Log()
    monkeypatch.setattr(pinning, "address_of", lambda owner: 1 << 40)
    pinner = HostPinner(log.register, log.unregister, drain=log.drain)
    old, new = M(-1, 4096), M(-1, 4096)
    assert pinner.add_buffer(memoryview(old))
    assert pinner.add_buffer(memoryview(new))
    assert pinner.wait_idle(10)
    base = 1 << 40
    assert log.calls in (
        [("register", base), ("drain", 0), ("unregister", base), ("register", base)],
        [("drain", 0), ("register", base)],  # the old one was retired before its turn
    )
    assert pinner.is_pinned(base, 4096)
    pinner.close()

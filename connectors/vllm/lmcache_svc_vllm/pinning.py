"""Page-locking the mapped shared segment, in the background.

Copies between device memory and *pageable* host memory go through a driver staging buffer
at roughly half the PCIe rate; registering the mapped segment with ``cudaHostRegister``
makes the slots DMA targets. Registering a large arena takes long (the driver touches and
locks every page), so ``HostPinner`` registers each mapping on a background thread and the
engine never waits for it: a copy into a mapping that is not registered yet still works, at
pageable speed.

A mapping is registered in one piece by default. Registering it in parts (``part_bytes``)
would pin the first parts sooner, but on an H100 (driver 580, CUDA 13) a copy whose range
spans two registrations, or a registered part and a pageable one, fails with
``cudaErrorInvalidValue`` (``scripts/gpu_check.sh`` probes it), and a slot can lie across
any boundary the arena's layout does not know of. ``part_bytes`` is for tests of the
bookkeeping and for ranges no copy crosses.

Each distinct mapping (``memoryview.obj`` of the slot buffers the client hands out: the
read-write mapping for stores, the read-only one for loads) is registered once, the
read-only one with the read-only flag. ``close`` waits for the thread and unregisters every
part it registered, before the mappings are closed.

The register/unregister functions are injected: ``cuda_host_registrar`` gives the real
ones (CUDA only); tests pass recording functions.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(f"vllm.{__name__}")

Register = Callable[[int, int, bool], None]
"""``register(address, nbytes, read_only)``: page-lock the range or raise."""
Unregister = Callable[[int], None]
"""``unregister(address)``: undo one ``register`` of a range starting there."""

_CUDA_HOST_REGISTER_PORTABLE = 0x01
_CUDA_HOST_REGISTER_READ_ONLY = 0x08


@dataclass(frozen=True, slots=True)
class Part:
    address: int
    nbytes: int
    read_only: bool


class HostPinner:
    """Registers mappings (whole, or part by part) on one background thread; thread-safe."""

    def __init__(
        self, register: Register, unregister: Unregister, *, part_bytes: int | None = None
    ) -> None:
        """``part_bytes``: None registers each mapping whole (see the module's docstring)."""
        if part_bytes is not None and (part_bytes <= 0 or part_bytes % 4096):
            raise ValueError(f"part_bytes must be a positive multiple of 4096, got {part_bytes}")
        self._register = register
        self._unregister = unregister
        self.part_bytes = part_bytes
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._mappings: set[int] = set()  # base addresses seen
        self._queue: deque[Part] = deque()
        self._registered: list[Part] = []
        self._failed: list[Part] = []
        self._num_parts = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    def add_buffer(self, buffer: memoryview) -> bool:
        """Schedule the mapping that ``buffer`` is a slice of; False if already known or not
        a slice of an ``mmap`` (inline transfers hand out short-lived ``bytearray``s, which
        must never be registered)."""
        owner: Any = buffer.obj
        if not isinstance(owner, mmap.mmap):
            return False
        base, size = address_of(owner), len(owner)
        return self.add_range(base, size, read_only=buffer.readonly)

    def add_range(self, base: int, size: int, *, read_only: bool) -> bool:
        with self._lock:
            if self._closed or base in self._mappings or size <= 0:
                return False
            self._mappings.add(base)
            step = self.part_bytes or size
            for offset in range(0, size, step):
                n = min(step, size - offset)
                self._queue.append(Part(base + offset, n, read_only))
                self._num_parts += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="lmcache-svc-pin", daemon=True
                )
                self._thread.start()
            self._wake.notify()
        return True

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                part = self._queue.popleft()
            try:
                self._register(part.address, part.nbytes, part.read_only)
            except Exception as e:  # stays pageable: slower, still correct
                logger.warning("lmcache-svc: page-locking %d bytes failed: %s", part.nbytes, e)
                with self._lock:
                    self._failed.append(part)
                    self._wake.notify_all()
                continue
            with self._lock:
                self._registered.append(part)
                self._wake.notify_all()

    def is_pinned(self, address: int, nbytes: int) -> bool:
        """True when ``[address, address + nbytes)`` lies in registered parts."""
        with self._lock:
            parts = sorted(self._registered, key=lambda p: p.address)
        end, covered = address + nbytes, address
        for p in parts:
            if p.address <= covered < p.address + p.nbytes:
                covered = p.address + p.nbytes
            if covered >= end:
                return True
        return nbytes == 0

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until every scheduled part was tried (tests, benchmarks)."""
        with self._lock:
            return self._wake.wait_for(
                lambda: (
                    self._closed or len(self._registered) + len(self._failed) >= self._num_parts
                ),
                timeout_s,
            )

    @property
    def registered(self) -> list[Part]:
        with self._lock:
            return list(self._registered)

    @property
    def closed(self) -> bool:
        """``close()`` was called: nothing more is registered."""
        with self._lock:
            return self._closed

    def close(self) -> None:
        """Stop registering and unregister every registered part (before unmapping)."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._wake.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            parts, self._registered = self._registered, []
        for part in parts:
            try:
                self._unregister(part.address)
            except Exception as e:
                logger.warning("lmcache-svc: unregistering pinned memory failed: %s", e)


def address_of(owner: Any) -> int:
    """Address of the first byte of a buffer exporter (an ``mmap``, read-only or not).

    The temporary tensor holds an export of ``owner`` only inside this call, so the mapping
    can still be closed afterwards."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        probe = torch.frombuffer(owner, dtype=torch.uint8, count=1)
    try:
        return int(probe.data_ptr())
    finally:
        del probe


def cuda_host_registrar() -> tuple[Register, Unregister]:
    """``cudaHostRegister``/``cudaHostUnregister`` through torch's CUDA runtime binding."""
    cudart = torch.cuda.cudart()

    def register(address: int, nbytes: int, read_only: bool) -> None:
        flags = _CUDA_HOST_REGISTER_PORTABLE | (_CUDA_HOST_REGISTER_READ_ONLY if read_only else 0)
        torch.cuda.check_error(cudart.cudaHostRegister(address, nbytes, flags))

    def unregister(address: int) -> None:
        torch.cuda.check_error(cudart.cudaHostUnregister(address))

    return register, unregister

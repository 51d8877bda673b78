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
read-only one with the read-only flag. The pinner keeps each mapping it registered open:
unmapped while registered, its pages would stay locked in memory until the engine exits
(the driver holds them), and a new mapping at the same address would pass for registered.
When the client maps a newer segment (the server restarted), the buffers of the new
mapping retire the older one of the same access: on the thread, ``drain`` (the device's
queued copies finish), then every part is unregistered and the mapping let go.
``close`` waits for the thread and unregisters every part it registered, before the
mappings are closed.

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


@dataclass(eq=False, slots=True)
class _Mapping:
    """A mapping scheduled for registration: ``owner`` (the ``mmap``; None for a bare
    range) is kept open until its parts are unregistered."""

    owner: Any
    base: int
    read_only: bool
    parts: list[Part]


class HostPinner:
    """Registers mappings (whole, or part by part) on one background thread; thread-safe."""

    def __init__(
        self,
        register: Register,
        unregister: Unregister,
        *,
        part_bytes: int | None = None,
        drain: Callable[[], None] = lambda: None,
    ) -> None:
        """``part_bytes``: None registers each mapping whole (see the module's docstring).
        ``drain``: returns once no copy touches host memory any more (the device's
        queued work), before a retired mapping is unregistered."""
        if part_bytes is not None and (part_bytes <= 0 or part_bytes % 4096):
            raise ValueError(f"part_bytes must be a positive multiple of 4096, got {part_bytes}")
        self._register = register
        self._unregister = unregister
        self._drain = drain
        self.part_bytes = part_bytes
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._mappings: list[_Mapping] = []  # scheduled and not retired
        self._queue: deque[Part | _Mapping] = deque()  # a part to register, or to retire
        self._busy = False  # the thread is working on a task it took from the queue
        self._registered: list[Part] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    def add_buffer(self, buffer: memoryview) -> bool:
        """Schedule the mapping that ``buffer`` is a slice of; False if already known or not
        a slice of an ``mmap`` (inline transfers hand out short-lived ``bytearray``s, which
        must never be registered). An older mapping of the same access is retired."""
        owner: Any = buffer.obj
        if not isinstance(owner, mmap.mmap):
            return False
        read_only = buffer.readonly
        with self._lock:
            if any(m.owner is owner for m in self._mappings):
                return False
        base = address_of(owner)
        with self._lock:
            if self._closed:
                return False
            # Unregistered first: the new mapping may lie at the same address.
            for old in [m for m in self._mappings if m.owner is not None]:
                if old.read_only == read_only:
                    self._retire(old)
            return self._add(owner, base, len(owner), read_only)

    def add_range(self, base: int, size: int, *, read_only: bool) -> bool:
        """Schedule a bare range (not retired by later ones); False if known or empty."""
        with self._lock:
            return self._add(None, base, size, read_only)

    def _add(self, owner: Any, base: int, size: int, read_only: bool) -> bool:
        if (
            self._closed
            or size <= 0
            or any(m.owner is owner and m.base == base for m in self._mappings)
        ):
            return False
        step = self.part_bytes or size
        parts = [
            Part(base + offset, min(step, size - offset), read_only)
            for offset in range(0, size, step)
        ]
        self._mappings.append(_Mapping(owner, base, read_only, parts))
        self._queue.extend(parts)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lmcache-svc-pin", daemon=True)
            self._thread.start()
        self._wake.notify()
        return True

    def _retire(self, mapping: _Mapping) -> None:
        """(Under the lock.) No more parts of ``mapping`` are registered; the thread
        unregisters those that were, then lets the mapping go."""
        self._mappings.remove(mapping)
        pending = {id(p) for p in mapping.parts}
        self._queue = deque(t for t in self._queue if id(t) not in pending)
        self._queue.append(mapping)
        self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._busy = False
                self._wake.notify_all()
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                task = self._queue.popleft()
                self._busy = True
            if isinstance(task, Part):
                self._register_part(task)
            else:
                self._unregister_mapping(task)

    def _register_part(self, part: Part) -> None:
        try:
            self._register(part.address, part.nbytes, part.read_only)
        except Exception as e:  # stays pageable: slower, still correct
            logger.warning("lmcache-svc: page-locking %d bytes failed: %s", part.nbytes, e)
            return
        with self._lock:
            self._registered.append(part)

    def _unregister_mapping(self, mapping: _Mapping) -> None:
        try:
            self._drain()
        except Exception as e:
            logger.warning("lmcache-svc: waiting for the device's copies failed: %s", e)
        ids = {id(p) for p in mapping.parts}
        with self._lock:
            done = [p for p in self._registered if id(p) in ids]
            self._registered = [p for p in self._registered if id(p) not in ids]
        self._unregister_all(done)
        logger.info(
            "lmcache-svc: unregistered a replaced %s mapping (%d part(s))",
            "read-only" if mapping.read_only else "writable",
            len(done),
        )

    def _unregister_all(self, parts: list[Part]) -> None:
        for part in parts:
            try:
                self._unregister(part.address)
            except Exception as e:
                logger.warning("lmcache-svc: unregistering pinned memory failed: %s", e)

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
        """Wait until every scheduled part was tried and every retired mapping let go
        (tests, benchmarks)."""
        with self._lock:
            return self._wake.wait_for(
                lambda: self._closed or (not self._queue and not self._busy), timeout_s
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
            self._mappings.clear()
        self._unregister_all(parts)


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


def cuda_drain(device: torch.device) -> Callable[[], None]:
    """``HostPinner``'s ``drain`` on CUDA: returns once every queued copy on ``device`` ran
    (the forward pass's and the plugin's copy streams alike)."""
    return lambda: torch.cuda.synchronize(device)

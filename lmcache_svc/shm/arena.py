"""The POSIX shared-memory slab arena behind the CPU tier.

The server owns one segment, ``/dev/shm/<name>``; same-host clients map it by name
(``ArenaMapping``) and copy chunk bytes in place, addressed by ``Slot`` (offset, length).

Layout: the first 4096 bytes are a header, ``MAGIC`` then a random 16-byte nonce, so a
client that maps a same-named segment on another host can tell it is not ours. Slots are
4096-aligned offsets after it.

Allocation: ``slab.SlabAllocator`` (size classes of 4096-byte multiples, slabs of
``slab_bytes``, runs of slabs for larger classes) picks the offsets; this module owns the
memory, the lock and the argument checks.

Pre-faulting: on this VM the first touch of a page is far slower than later ones, so the
arena allocates and maps its pages at start-up (``posix_fallocate`` + ``MADV_POPULATE_WRITE``,
64 MiB at a time, by default in a daemon thread; madvise goes through ctypes because
``mmap.madvise`` holds the GIL: another thread got 1 tick in 3.3 s while it populated 1 GiB).
Measured here (2 vCPUs, kernel 6.18), copying 256 MiB with one memoryview slice assignment:
- fresh arena: first copy 0.32-0.87 GB/s while the VM's memory was still untouched, 1.1-1.5 GB/s
  once the guest had used those pages before; a second copy 11-17 GB/s.
- pre-faulted arena: first copy 6.7-16 GB/s (mostly 15-16). Pre-faulting 256 MiB took
  143-188 ms in the background (1 GiB of never-touched memory: 3.3-3.9 s).
- a client mapping (``ArenaMapping``) of pages the server already populated still pays minor
  faults: first copy 1.8-2.9 GB/s; pre-faulted (60-130 ms per 256 MiB, background) 7-17 GB/s.
So clients pre-fault too: ``ArenaMapping.open(..., prefault=True)``, which every client asks
for when it maps a session's segment (``map_segment``), populates the read-write mapping and
then the read-only one in a daemon thread (``CacheClient.wait_shm_ready`` waits for it). The
price is the client's page tables: 2 MiB per GiB of segment for each of the two mappings.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import numpy as np

from lmcache_svc.errors import ConfigError, InvalidArgument
from lmcache_svc.shm.slab import ALIGN, SlabAllocator, round_up
from lmcache_svc.tiers.base import Slot

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
MAGIC = b"LMCSVCA1"
NONCE_BYTES = 16
HEADER_BYTES = 4096
DEFAULT_SLAB_BYTES = 64 << 20
PREFAULT_RANGE_BYTES = 64 << 20
MADV_POPULATE_READ: int = getattr(mmap, "MADV_POPULATE_READ", 22)
MADV_POPULATE_WRITE: int = getattr(mmap, "MADV_POPULATE_WRITE", 23)
ARENA_TRANSPORT = "shm"
"""``SegmentInfo.transport`` of an arena: clients on the same host map it (``ArenaMapping``)."""
CREATING_PREFIX = ".lmcache-svc-creating-"
"""Hidden name of a segment file between its creation and its locking (never a segment name:
those may not start with '.')."""

Prefault = Literal["off", "background", "sync"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


def check_segment_name(name: str) -> str:
    """A segment name: letters, digits, '-', '_', '.', at most 200 chars, not '.'-led."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or name.startswith("."):
        raise InvalidArgument(
            f"bad shared-memory segment name {name!r}: use letters, digits, '-', '_', '.' "
            "(at most 200 chars, not starting with '.')"
        )
    return name


def _shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, check_segment_name(name))


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise through ctypes, which drops the GIL while the kernel populates pages
    (``mmap.madvise`` holds it: a 64 MiB range would stall every other thread ~0.25 s)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_MADVISE = _libc_madvise()


def _address_of(mm: mmap.mmap) -> int:
    """Start address of a mapping, read-only ones included (``ctypes.from_buffer`` needs a
    writable buffer); the buffer export is released before returning."""
    anchor = np.frombuffer(mm, dtype=np.uint8)
    address = int(anchor.__array_interface__["data"][0])
    del anchor
    return address


def _populate(
    fd: int | None, mm: mmap.mmap, address: int, start: int, length: int, advice: int
) -> None:
    """Allocate (server only: ``fd``) and map the pages of ``[start, start + length)``
    (``advice``: MADV_POPULATE_WRITE, or MADV_POPULATE_READ for a read-only mapping)."""
    if fd is not None:
        os.posix_fallocate(fd, start, length)  # also fails early with ENOSPC, not SIGBUS
    try:
        if _MADVISE is None:
            mm.madvise(advice, start, length)
        elif _MADVISE(address + start, length, advice) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise({advice}) to populate: {os.strerror(err)}")
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        mm[start : start + length : mmap.PAGESIZE]  # kernel before 5.14: read a byte per page


class _Prefaulter:
    """Populates a whole mapping range by range, inline or in a daemon thread; stoppable."""

    def __init__(self, fd: int | None, mms: list[mmap.mmap], what: str) -> None:
        """``mms``: the mappings to populate, the first writable, a second read-only."""
        self.done = threading.Event()
        self._stop = threading.Event()
        self._fd, self._what = fd, what
        advices = [MADV_POPULATE_WRITE, MADV_POPULATE_READ]
        self._targets = [(mm, _address_of(mm), advice) for mm, advice in zip(mms, advices)]
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        try:
            for mm, address, advice in self._targets:
                fd, self._fd = self._fd, None  # allocate once, with the first mapping
                size = len(mm)
                for start in range(0, size, PREFAULT_RANGE_BYTES):
                    if self._stop.is_set():
                        return
                    length = min(PREFAULT_RANGE_BYTES, size - start)
                    _populate(fd, mm, address, start, length, advice)
        finally:
            self.done.set()

    def start(self) -> None:
        def run_logged() -> None:
            try:
                self.run()
            except OSError as e:
                log.warning("pre-faulting %s stopped: %s", self._what, e)

        self._thread = threading.Thread(target=run_logged, name=f"prefault-{self._what}")
        self._thread.daemon = True
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class Arena:
    """Server side: owns the shared-memory segment and allocates slots in it. Thread-safe.

    Build with ``Arena.create``. ``capacity_bytes`` is the usable area after the header;
    the segment (``segment_size`` bytes) is that plus ``HEADER_BYTES``.
    """

    def __init__(self, name: str, fd: int, mm: mmap.mmap, allocator: SlabAllocator) -> None:
        self.name = name
        self.nonce = bytes(mm[len(MAGIC) : len(MAGIC) + NONCE_BYTES])
        self.segment_size = len(mm)
        self._fd = fd
        self._mm: mmap.mmap | None = mm
        self._buf = memoryview(mm)
        self._alloc = allocator
        self._lock = threading.Lock()
        self._prefaulter = _Prefaulter(fd, [mm], name)
        self.prefault_done = self._prefaulter.done

    @classmethod
    def create(
        cls,
        size_bytes: int,
        *,
        slab_bytes: int = DEFAULT_SLAB_BYTES,
        name: str | None = None,
        mode: int = 0o600,
        prefault: Prefault = "background",
    ) -> Arena:
        """Create ``/dev/shm/<name>`` with ``size_bytes`` (rounded up to 4096) usable bytes."""
        _check_sizes(size_bytes, slab_bytes)
        if prefault not in ("off", "background", "sync"):
            raise InvalidArgument(f"prefault must be off, background or sync, got {prefault!r}")
        name = name if name is not None else f"lmcache-svc-{os.getpid()}-{secrets.token_hex(4)}"
        capacity = round_up(size_bytes)
        mm, fd = _create_segment(name, HEADER_BYTES + capacity, mode)
        arena = cls(name, fd, mm, SlabAllocator(HEADER_BYTES, capacity, slab_bytes))
        arena._start_prefault(prefault)
        return arena

    def _start_prefault(self, prefault: Prefault) -> None:
        if prefault == "off":
            self.prefault_done.set()
        elif prefault == "background":
            self._prefaulter.start()
        else:
            try:
                self._prefaulter.run()
            except OSError as e:
                self.close()
                raise ConfigError(f"cannot pre-fault shared memory {self.name!r}: {e}") from e

    def wait_prefaulted(self, timeout: float | None = None) -> bool:
        return self.prefault_done.wait(timeout)

    @property
    def capacity_bytes(self) -> int:
        return self._alloc.capacity_bytes

    @property
    def slab_bytes(self) -> int:
        return self._alloc.slab_bytes

    @property
    def used_bytes(self) -> int:
        """Sum of the size classes of allocated slots."""
        return self._alloc.used_bytes

    @property
    def num_slots(self) -> int:
        return self._alloc.num_slots

    @property
    def closed(self) -> bool:
        return self._mm is None

    def allocate(self, nbytes: int) -> Slot | None:
        """A slot of ``nbytes`` (its class: rounded up to 4096), or ``None`` when full."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise InvalidArgument(f"slot size must be an integer, got {nbytes!r}")
        if not 0 < nbytes <= self.capacity_bytes:
            raise InvalidArgument(
                f"slot size must be in [1, {self.capacity_bytes}] bytes, got {nbytes}"
            )
        with self._lock:
            self._check_open()
            offset = self._alloc.allocate(nbytes)
        return None if offset is None else Slot(offset, nbytes)

    def free(self, slot: Slot) -> None:
        with self._lock:
            self._check_open()
            self._alloc.free(slot.offset, slot.length)

    def class_bytes_of(self, slot: Slot) -> int:
        """Bytes ``slot`` takes from the arena (its size class)."""
        with self._lock:
            class_bytes = self._alloc.class_bytes_of(slot.offset)
        if class_bytes is None:
            raise RuntimeError(f"arena {self.name!r}: offset {slot.offset} is not allocated")
        return class_bytes

    def view(self, slot: Slot) -> memoryview:
        """Writable view of exactly ``slot.length`` bytes of an allocated slot."""
        with self._lock:
            self._check_open()
            length = self._alloc.length_of(slot.offset)
        if length != slot.length:
            raise RuntimeError(
                f"arena {self.name!r}: view of {slot} which is not an allocated slot"
            )
        return self._buf[slot.offset : slot.offset + slot.length]

    def _check_open(self) -> None:
        if self._mm is None:
            raise RuntimeError(f"arena {self.name!r} is closed")

    def close(self) -> None:
        """Unlink the segment and release the mapping; idempotent, never raises.

        Views still alive keep the memory mapped (``mmap`` refuses to unmap exported
        buffers) until they are released; the name is gone at once either way.
        """
        with self._lock:
            mm, self._mm = self._mm, None
        if mm is None:
            return
        self._prefaulter.stop()
        _unlink_quietly(self.name)
        os.close(self._fd)
        _close_mmap(self._buf, mm)


def _check_sizes(size_bytes: int, slab_bytes: int) -> None:
    for what, value in (("arena size", size_bytes), ("slab size", slab_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidArgument(f"{what} must be a positive integer, got {value!r}")
    if slab_bytes % ALIGN:
        raise InvalidArgument(f"slab size must be a multiple of {ALIGN}, got {slab_bytes}")


def _create_segment(name: str, size: int, mode: int) -> tuple[mmap.mmap, int]:
    """Create, size and map ``/dev/shm/<name>``, header written; converts OS errors."""
    path = _shm_path(name)
    try:
        st = os.statvfs(SHM_DIR)
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        if size > free:
            raise ConfigError(
                f"{path} needs {size >> 20} MiB but {SHM_DIR} has {free >> 20} MiB free "
                f"(its size: {total >> 20} MiB): lower cpu.capacity or give {SHM_DIR} more "
                "room (docker run --shm-size, shm_size in compose, the /dev/shm volume's "
                "sizeLimit in Kubernetes)"
            )
        fd = _open_new(path, mode)
    except FileExistsError:
        raise ConfigError(
            f"shared-memory segment {path} already exists (another server's, "
            "or a stale one: remove it or pick another name)"
        ) from None
    except OSError as e:
        raise ConfigError(f"cannot create shared-memory segment {path}: {e}") from e
    try:
        os.fchmod(fd, mode)  # exact mode, whatever the umask
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        os.close(fd)
        _unlink_quietly(name)
        raise ConfigError(f"cannot size or map shared-memory segment {path}: {e}") from e
    mm[: len(MAGIC) + NONCE_BYTES] = MAGIC + secrets.token_bytes(NONCE_BYTES)
    return mm, fd


def _open_new(path: str, mode: int) -> int:
    """Create the segment file already locked for the server's lifetime; an existing file
    that no live server holds (its server was killed) is removed first.

    The file is created and locked under a hidden name that the orphan clean-up ignores
    (``CREATING_PREFIX``), then linked into place (``link`` never replaces an existing name):
    a starting server's clean-up can never find it unlocked under its real name. Only a
    server killed in between leaves the hidden, still empty file behind.
    """
    creating = os.path.join(SHM_DIR, f"{CREATING_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(creating, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else knows this name yet
        try:
            os.link(creating, path)
        except FileExistsError:
            if not _remove_if_orphan(path):
                raise
            os.link(creating, path)
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.unlink(creating)
    return fd


def _remove_if_orphan(path: str) -> bool:
    """Unlink a segment whose server is gone: nobody holds its lock. True if removed."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # a live server holds it
    else:
        try:
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                return False  # replaced meanwhile: the new file is not the one we judged
            os.unlink(path)
        except FileNotFoundError:
            return False  # another starting server removed it first
        log.warning("removed %s, left by a server that was killed", path)
        return True
    finally:
        os.close(fd)


def remove_orphan_segments(prefix: str = "lmcache-svc-") -> list[str]:
    """Remove this user's segments named ``prefix*`` whose server is gone (not locked).

    A server holds an exclusive ``flock`` on its segment from before the segment has its
    name (``_open_new``) for the server's whole lifetime, so the lock is free exactly when
    the server died without cleaning up (SIGKILL, OOM); the lock alone decides, however
    recently the segment was created or touched. The check works across PID namespaces
    (containers sharing /dev/shm).
    """
    removed: list[str] = []
    for entry in os.scandir(SHM_DIR):
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if (
            not entry.name.startswith(prefix)
            or not entry.is_file(follow_symlinks=False)
            or st.st_uid != os.getuid()
        ):
            continue
        if _remove_if_orphan(entry.path):
            removed.append(entry.name)
    return removed


def _unlink_quietly(name: str) -> None:
    try:
        os.unlink(_shm_path(name))
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("could not unlink shared-memory segment %s: %s", name, e)


def _close_mmap(buf: memoryview, mm: mmap.mmap) -> None:
    try:
        buf.release()
        mm.close()
    except BufferError:
        pass  # views are alive: the mapping goes when the last one is released


class ArenaMapping:
    """Client side: a server's segment mapped twice, read-write for stores and read-only for
    loads, checked by its nonce.

    Load buffers come from the read-only mapping (``view(..., writable=False)``), so a
    reader's stray write raises ``TypeError`` instead of changing what every later reader
    of the chunk gets; only reserved slots are handed out writable. The second mapping
    costs page tables, not memory (same pages), and is pre-faulted with the first.
    """

    def __init__(self, name: str, mm: mmap.mmap, mm_read: mmap.mmap) -> None:
        self.name = name
        self.size = len(mm)
        self._mm: mmap.mmap | None = mm
        self._mm_read = mm_read
        self._buf = memoryview(mm)
        self._buf_read = memoryview(mm_read)
        self._prefaulter = _Prefaulter(None, [mm, mm_read], f"client-{name}")
        self.prefault_done = self._prefaulter.done

    @classmethod
    def open(
        cls, name: str, size: int, nonce: bytes, *, prefault: bool = False
    ) -> ArenaMapping | None:
        """Map ``/dev/shm/<name>``; ``None`` if it is missing, unreadable, of another size
        or not the segment whose header carries ``nonce`` (e.g. one on another host)."""
        path = _shm_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != size or size < HEADER_BYTES:
                return None
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            mm_read = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError:
            return None
        finally:
            os.close(fd)
        if mm[: len(MAGIC) + NONCE_BYTES] != MAGIC + bytes(nonce):
            mm.close()
            mm_read.close()
            return None
        mapping = cls(name, mm, mm_read)
        if prefault:
            mapping._prefaulter.start()
        else:
            mapping.prefault_done.set()
        return mapping

    def covers(self, offset: int, length: int) -> bool:
        """Whether ``[offset, offset + length)`` lies within the slots (after the header)."""
        return HEADER_BYTES <= offset and 0 <= length and offset + length <= self.size

    def view(self, offset: int, length: int, *, writable: bool = True) -> memoryview:
        """View of ``[offset, offset + length)``, which must lie after the header: writable
        (a reserved slot) or read-only (a leased chunk)."""
        if self._mm is None:
            raise RuntimeError(f"mapping of {self.name!r} is closed")
        if not self.covers(offset, length):
            raise InvalidArgument(
                f"range [{offset}, {offset}+{length}) is outside the slots of segment "
                f"{self.name!r} ([{HEADER_BYTES}, {self.size}))"
            )
        buf = self._buf if writable else self._buf_read
        return buf[offset : offset + length]

    def close(self) -> None:
        """Release the mappings (idempotent; live views keep them until they are released)."""
        mm, self._mm = self._mm, None
        if mm is None:
            return
        self._prefaulter.stop()
        _close_mmap(self._buf, mm)
        _close_mmap(self._buf_read, self._mm_read)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

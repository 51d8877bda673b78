"""File I/O helpers for tiers that keep chunks in files: whole-buffer ``pwritev``/``preadv``,
O_DIRECT-safe transfers of a header block plus a body (aligned bytes in place, the rest through
a per-thread aligned bounce buffer), unlink/fsync with OS errors converted to ``TierError``,
and a small lazily started thread pool for batches. No tier policy lives here."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from lmcache_svc.errors import TierError
from lmcache_svc.tiers.base import Failed, ItemResult

DIRECT_ALIGN = 4096
"""O_DIRECT alignment of buffer addresses, file offsets and transfer lengths."""

_MIN_BOUNCE_BYTES = 2 * DIRECT_ALIGN
_MAX_RW = 0x7FFFF000  # Linux moves at most this many bytes per read/write call


def align_up(n: int) -> int:
    return -(-n // DIRECT_ALIGN) * DIRECT_ALIGN


def direct_body(view: memoryview) -> int:
    """How many leading bytes of ``view`` O_DIRECT can move in place (0 if it is unaligned)."""
    if int(np.frombuffer(view, dtype=np.uint8).ctypes.data) % DIRECT_ALIGN:
        return 0
    return len(view) - len(view) % DIRECT_ALIGN


class BounceBuffers:
    """Each thread's own page-aligned scratch buffer (an anonymous mmap), grown on demand."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, nbytes: int) -> memoryview:
        """This thread's buffer, at least ``nbytes`` long (its contents are left over)."""
        buf: memoryview | None = getattr(self._local, "bounce", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.bounce = memoryview(mmap.mmap(-1, max(nbytes, _MIN_BOUNCE_BYTES)))
        return buf


def write_head_and_body(
    fd: int, head: bytes, body: memoryview, bounce: BounceBuffers | None
) -> None:
    """Write ``head`` (one ``DIRECT_ALIGN`` block) then ``body`` from offset 0. With ``bounce``
    (O_DIRECT) the file is zero-padded to a whole block."""
    if bounce is None:
        pwrite_all(fd, [memoryview(head), body], 0)
        return
    block = DIRECT_ALIGN
    direct = direct_body(body)
    rest = len(body) - direct
    end = block + align_up(rest)
    buf = bounce.get(end)
    buf[:block] = head
    buf[block : block + rest] = body[direct:]
    buf[block + rest : end] = bytes(end - block - rest)
    pwrite_all(fd, [buf[:block], body[:direct], buf[block:end]], 0)


def read_head_and_body(
    fd: int, head_bytes: int, view: memoryview, bounce: BounceBuffers | None
) -> tuple[bytes, int]:
    """(up to ``head_bytes`` of the head block, body bytes read into ``view``) of a file
    written by ``write_head_and_body``; ``bounce`` for O_DIRECT."""
    block = DIRECT_ALIGN
    if bounce is None:
        head = bytearray(block)
        got = preadv_all(fd, [memoryview(head), view], 0)
        return bytes(head[: min(got, head_bytes)]), max(0, got - block)
    direct = direct_body(view)
    rest = len(view) - direct
    end = block + align_up(rest)
    buf = bounce.get(end)
    got = preadv_all(fd, [buf[:block], view[:direct], buf[block:end]], 0)
    view[direct:] = buf[block : block + rest]
    return bytes(buf[: min(got, head_bytes)]), min(max(0, got - block), len(view))


def advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """``bufs`` without their first ``n`` bytes, dropping empty buffers."""
    out = []
    for buf in bufs:
        skip = min(n, len(buf))
        n -= skip
        if len(buf) > skip:
            out.append(buf[skip:])
    return out


def pwrite_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    bufs = advance(bufs, 0)
    while bufs:
        written = os.pwritev(fd, bufs, offset)
        if not written:
            raise OSError(errno.EIO, "write made no progress")
        offset += written
        bufs = advance(bufs, written)


def preadv_all(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Bytes read into ``bufs`` from ``offset``, stopping at end of file."""
    bufs, total = advance(bufs, 0), 0
    while bufs:
        want = min(sum(len(b) for b in bufs), _MAX_RW)
        got = os.preadv(fd, bufs, offset)
        total, offset = total + got, offset + got
        if got < want:
            break
        bufs = advance(bufs, got)
    return total


def fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise TierError(f"fsync {directory}: {e.strerror}") from None


def unlink(path: str) -> None:
    """Remove ``path`` if it exists; other OS errors become ``TierError``."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise TierError(f"removing {path}: {e.strerror}") from None


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class IoThreads:
    """A few threads for one tier's batch I/O, started on first use and stopped by ``close``.

    ``name`` is the tier's: it prefixes the thread names and the log lines."""

    def __init__(self, num_threads: int, name: str, log: logging.Logger) -> None:
        self._num_threads = num_threads
        self._name = name
        self._log = log
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def run(
        self,
        what: str,
        keys: Sequence[bytes],
        calls: Sequence[Callable[[], bool] | None],
        *,
        parallel: bool = True,
    ) -> list[ItemResult]:
        """Each call's result in order (``None``: ``False``); ``Failed`` for a call that raised
        ``TierError``, which is logged with its key. Any other exception is raised once every
        call has finished. Calls run concurrently unless ``parallel`` is false or only one is
        given."""
        num_calls = sum(call is not None for call in calls)
        pool = self._executor() if parallel and num_calls > 1 else None
        futures = [None if call is None else _start(pool, call) for call in calls]
        results: list[ItemResult] = []
        error: BaseException | None = None
        for key, future in zip(keys, futures, strict=True):
            try:
                results.append(future is not None and future.result())
            except TierError as e:
                self._log.warning("tier %s: %s of %s failed: %s", self._name, what, key.hex(), e)
                results.append(Failed(e))
            except BaseException as e:
                error = error or e
                results.append(False)
        if error is not None:
            raise error
        return results

    def close(self) -> None:
        """Stop the threads after their work; later batches run on the caller's thread."""
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=True)

    def _executor(self) -> ThreadPoolExecutor | None:
        with self._lock:
            if self._pool is None and not self._closed:
                prefix = f"{self._name}-io"
                self._pool = ThreadPoolExecutor(self._num_threads, thread_name_prefix=prefix)
            return self._pool


def _start(pool: ThreadPoolExecutor | None, call: Callable[[], bool]) -> Future[bool]:
    """``call`` submitted to ``pool``, or run here when there is none (or it was shut down)."""
    if pool is not None:
        try:
            return pool.submit(call)
        except RuntimeError:
            pass  # close() shut the pool down meanwhile
    future: Future[bool] = Future()
    try:
        future.set_result(call())
    except BaseException as e:
        future.set_exception(e)
    return future

"""Pre-touch (``pretouch_loads``): read a hit's chunks' pages before the worker copies them.

On one host (2 vCPUs, Intel) memory idle for a second was slow to read again, with no
page faults (the slowness is below the guest): copying 12.3 MB out of the shared segment
took 2.21-2.36 ms after 1.3 s idle, and 1.88-1.92 ms once another process had read one
byte of every page of it (docs/benchmarks.md, issue 23). The scheduler knows a hit's
chunks milliseconds before the worker copies them, so it reads one byte per page of them
first, on its lookup thread, never on vLLM's:

- a lease started ahead (``prefetch.py``): its slots are touched before the lease is handed
  over (before its future completes), so a touch never reads a slot after its release;
- a load read in place (the CPU default): the lookup's placement locates the chunks in the
  scheduler's own mapping of the segment, and their pages are touched there. There is no
  lease: a chunk may be evicted and its slot rewritten meanwhile, which a read cannot
  harm (the worker checks its own copy, ``in_place.py``).

Either way the touch reads through views of the mapping, and a live view keeps the mapping
mapped (``mmap`` refuses to close while its buffer is exported), so it never reads an
unmapped address. It only reads, and a failure is logged and ignored.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Sequence

logger = logging.getLogger(f"vllm.{__name__}")
PAGE_BYTES = mmap.PAGESIZE


def touch_pages(buffer: memoryview, page_bytes: int = PAGE_BYTES) -> int:
    """Read one byte of every memory page ``buffer`` spans, never writing: one every
    ``page_bytes`` from its first byte, and its last byte (a buffer that does not start a
    page ends in one page more); how many bytes were read.

    The reads are strided copies of a memoryview, in C, holding the GIL: about 1 us a
    buffer beside the pages' own latency (numpy's address and reduction took 4 us)."""
    data = memoryview(buffer).cast("B")  # its bytes, in one dimension
    return len(data[::page_bytes].tobytes()) + len(data[-1:].tobytes())


class PageToucher:
    """Touches buffers' pages and never raises: the first failure is logged as a warning,
    later ones at debug level."""

    def __init__(self) -> None:
        self._warned = False

    def touch(self, buffers: Sequence[memoryview]) -> int | None:
        """Bytes read from ``buffers`` (``touch_pages``); None when the touch failed."""
        try:
            return sum(touch_pages(b) for b in buffers)
        except Exception:  # never into vLLM: the load goes on untouched
            level = logging.DEBUG if self._warned else logging.WARNING
            self._warned = True
            logger.log(level, "lmcache-svc: a pre-touch of a load's pages failed", exc_info=True)
            return None

"""Pre-touch of a hit's pages (``pretouch.py``, ``pretouch_loads``): ``touch_pages`` reads
every page a buffer spans and nothing beyond (the kernel's page residency says which were
read); with the option on, a lease started ahead is touched before the worker takes it and a
load read in place is touched through the scheduler's mapping; off, nothing is touched; a
touch that fails changes nothing else."""

# ruff: noqa: E402  (imports after the torch check)
from __future__ import annotations

import ctypes
import logging
import mmap
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("torch", reason="the layout code needs torch (the [torch] extra)")
import torch
from lmcache_svc_vllm import pretouch
from lmcache_svc_vllm.prefetch import Prefetches
from lmcache_svc_vllm.pretouch import PAGE_BYTES, PageToucher, touch_pages

from lmcache_svc.client import CacheClient
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.helpers import count_calls, wait_until
from tests.vllm.test_prefetch import NUM_BLOCKS, active_leases, engine, schedule, store
from tests.vllm.test_worker_side import CHUNK, NAMESPACE

P = PAGE_BYTES
_libc = ctypes.CDLL(None, use_errno=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    proc = start_server(tmp_path_factory.mktemp("pretouch"))
    yield proc
    proc.cleanup()


def untouched(num_pages: int) -> mmap.mmap:
    """Anonymous memory no one has read yet, in small pages (a read maps each one)."""
    mm = mmap.mmap(-1, num_pages * P)
    mm.madvise(mmap.MADV_NOHUGEPAGE)
    return mm


def read_pages(mm: mmap.mmap) -> list[int]:
    """The pages of ``mm`` that are mapped in (``mincore``): the ones read so far."""
    num_pages = len(mm) // P
    vec = (ctypes.c_ubyte * num_pages)()
    address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    rc = _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(len(mm)), vec)
    assert rc == 0, f"mincore failed: errno {ctypes.get_errno()}"
    return [i for i in range(num_pages) if vec[i] & 1]


def test_every_page_of_a_mapping_is_read_and_nothing_written() -> None:
    mm = untouched(64)
    assert read_pages(mm) == []
    view = memoryview(mm).toreadonly()  # a write would raise
    assert touch_pages(view) == 64 + 1  # a byte a page, and the last byte
    assert read_pages(mm) == list(range(64))
    assert mm[:] == bytes(len(mm))  # still all zeros


@pytest.mark.parametrize(
    ("start", "stop", "pages"),
    [
        (100, 100 + 2 * P, [0, 1, 2]),  # two pages' bytes over three pages
        (P - 1, 2 * P + 1, [0, 1, 2]),  # a byte of the first page and of the last
        (100, 200, [0]),  # inside one page
        (3 * P, 5 * P, [3, 4]),  # whole pages
        (2 * P + 5, 5 * P - 5, [2, 3, 4]),
    ],
)
def test_a_buffer_not_on_page_boundaries_has_every_page_it_spans_read(
    start: int, stop: int, pages: list[int]
) -> None:
    mm = untouched(8)
    touch_pages(memoryview(mm).toreadonly()[start:stop])
    assert read_pages(mm) == pages


def test_an_empty_buffer_reads_nothing() -> None:
    mm = untouched(2)
    assert touch_pages(memoryview(mm)[P:P]) == 0
    assert PageToucher().touch([]) == 0
    assert read_pages(mm) == []


def test_a_buffer_of_wider_items_is_read_by_its_bytes() -> None:
    mm = untouched(4)
    touch_pages(memoryview(mm)[P : 3 * P].cast("Q"))
    assert read_pages(mm) == [1, 2]


def test_a_failed_touch_is_logged_once_as_a_warning_and_never_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    released = memoryview(bytearray(P))
    released.release()
    toucher = PageToucher()
    with caplog.at_level(logging.DEBUG, logger="vllm.lmcache_svc_vllm.pretouch"):
        assert toucher.touch([released]) is None
        assert toucher.touch([released]) is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.DEBUG]


# -- in the plugin ------------------------------------------------------------------------


def record_touches(
    monkeypatch: pytest.MonkeyPatch, pause_s: float = 0.0, fail: bool = False
) -> list[tuple[int, int]]:
    """Each buffer touched: (its first byte, its length); ``pause_s``: each touch takes that
    long more; ``fail``: each touch raises instead."""
    touched: list[tuple[int, int]] = []
    real = pretouch.touch_pages

    def recorded(buffer: memoryview, page_bytes: int = PAGE_BYTES) -> int:
        if fail:
            raise RuntimeError("a touch that fails")
        time.sleep(pause_s)
        touched.append((buffer[0], buffer.nbytes))
        return real(buffer, page_bytes)

    monkeypatch.setattr(pretouch, "touch_pages", recorded)
    return touched


def loaded_chunks(layers: list[torch.Tensor]) -> bool:
    """Chunk i's bytes (i + 1) in its two blocks (2-3, 4-5) of every layer."""
    pages = [layer.view(NUM_BLOCKS, -1).view(torch.uint8) for layer in layers]
    return all(bool((p[2:4] == 1).all()) and bool((p[4:6] == 2).all()) for p in pages)


def test_a_lease_started_ahead_is_touched_before_the_worker_takes_it(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefetches = Prefetches()
    scheduler, worker, layers = engine(server.socket, prefetches, pretouch_loads=True)
    prompt = list(range(21000, 21000 + 2 * CHUNK + 10))
    store(server, prompt, 2)
    touched = record_touches(monkeypatch, pause_s=0.2)  # slow: a worker not waiting copies first
    leases = count_calls(monkeypatch, worker.link._client, "prepare_load")
    try:
        plan = schedule(scheduler, "t1", prompt)
        worker.bind(plan)
        worker.start_load(plan)
        assert touched == [(1, NAMESPACE.chunk_bytes), (2, NAMESPACE.chunk_bytes)]
        assert worker.take_load_errors() == set() and len(leases) == 1  # the one started ahead
        assert loaded_chunks(layers)
        wait_until(lambda: active_leases(server) == 0, 10, "the lease released after the copy")
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_without_the_option_a_lease_started_ahead_is_not_touched(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefetches = Prefetches()
    scheduler, worker, layers = engine(server.socket, prefetches)
    prompt = list(range(23000, 23000 + 2 * CHUNK + 10))
    store(server, prompt, 2)
    touched = record_touches(monkeypatch)
    try:
        plan = schedule(scheduler, "t2", prompt)
        worker.bind(plan)
        worker.start_load(plan)
        assert worker.take_load_errors() == set() and loaded_chunks(layers)
        assert touched == []
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_a_touch_that_fails_leaves_the_lease_to_the_worker(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    prefetches = Prefetches()
    scheduler, worker, layers = engine(server.socket, prefetches, pretouch_loads=True)
    prompt = list(range(25000, 25000 + 2 * CHUNK + 10))
    store(server, prompt, 2)
    record_touches(monkeypatch, fail=True)
    leases = count_calls(monkeypatch, worker.link._client, "prepare_load")
    try:
        plan = schedule(scheduler, "t3", prompt)
        worker.bind(plan)
        worker.start_load(plan)
        assert worker.take_load_errors() == set() and loaded_chunks(layers)
        assert len(leases) == 1, "the worker leased again: the lease started ahead was lost"
        assert "a pre-touch of a load's pages failed" in caplog.text
        wait_until(lambda: active_leases(server) == 0, 10, "the lease released after the copy")
    finally:
        worker.shutdown()
        scheduler.shutdown()


@pytest.mark.parametrize("pretouch_loads", [True, False])
def test_a_load_read_in_place_is_touched_where_the_lookup_found_it(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch, pretouch_loads: bool
) -> None:
    """No lease (a worker that reads in place attaches to nothing): the scheduler touches
    the chunks through its own mapping, at the lookup's placement, with the option on."""
    prefetches = Prefetches()
    scheduler, worker, layers = engine(
        server.socket, prefetches, read_in_place=True, pretouch_loads=pretouch_loads
    )
    worker.link.warm_up()
    prompt = list(range(27000, 27000 + 2 * CHUNK + 10))
    store(server, prompt, 2)
    touched = record_touches(monkeypatch)
    leases = count_calls(monkeypatch, CacheClient, "prepare_load")
    located = count_calls(monkeypatch, scheduler.link._client, "read_in_place")
    try:
        plan = schedule(scheduler, f"t4-{pretouch_loads}", prompt)
        assert plan.loads[0].placement is not None  # the scheduler's lookup used the index
        scheduler._submit(lambda: None).result()  # the lookup thread has run what it had
        if pretouch_loads:
            assert touched == [(1, NAMESPACE.chunk_bytes), (2, NAMESPACE.chunk_bytes)]
            assert [call[2] for call in located] == [plan.loads[0].placement]
        else:
            assert touched == [] and located == []
        worker.bind(plan)
        worker.start_load(plan)
        assert worker.take_load_errors() == set() and loaded_chunks(layers)
        assert leases == [] and len(prefetches) == 0
    finally:
        worker.shutdown()
        scheduler.shutdown()

"""The data paths ``bench dataplane`` times, each moving the same bytes from and to the
same pre-touched buffers: a plain torch copy to and from /dev/shm pages (the baseline), the
shared-memory store and load the vLLM plugin does, inline gRPC ``put``/``get`` and REST
octet-stream ``PUT``/``GET``.

The shared-memory paths follow the plugin's worker (connectors/vllm/lmcache_svc_vllm/
worker.py): one ``prepare_store`` for a request's chunks, a torch copy into each reserved
slot, one ``commit_store``; one ``prepare_load``, a torch copy out of each leased slot, one
``release_load``. The commit and the release go to an I/O thread, as in the plugin's
worker, so the next request's prepare and copies overlap them; the clock stops when all have
returned. The prepares are paid in full (the plugin overlaps the store's with the forward
pass).
"""

from __future__ import annotations

import mmap
import os
import secrets
import tempfile
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import httpx
import numpy as np
import torch

from lmcache_svc.client import CacheClient
from lmcache_svc.client.store_pool import StorePool
from lmcache_svc.keys import KVLayout, Namespace
from lmcache_svc.shm.arena import MADV_POPULATE_WRITE, SHM_DIR

# 32 KiB per token like the LMCache side-by-side: fp16, 32 layers, 2 KV heads of 128, K and V.
BENCH_LAYOUT = KVLayout("float16", 32, 2, 128, 16, "bench/opaque")


def namespace_for(chunk_bytes: int) -> Namespace:
    per_token = BENCH_LAYOUT.bytes_per_token
    if chunk_bytes % per_token:
        raise ValueError(f"chunk size {chunk_bytes} is not a multiple of {per_token} bytes")
    return Namespace("bench/dataplane", BENCH_LAYOUT, chunk_size=chunk_bytes // per_token)


@dataclass(frozen=True, slots=True)
class Workload:
    """``total_bytes`` moved as requests of ``chunks_per_request`` chunks of ``chunk_bytes``."""

    chunk_bytes: int
    total_bytes: int
    request_bytes: int

    @property
    def chunks_per_request(self) -> int:
        return max(1, self.request_bytes // self.chunk_bytes)

    @property
    def num_requests(self) -> int:
        return max(1, self.total_bytes // (self.chunks_per_request * self.chunk_bytes))

    @property
    def moved_bytes(self) -> int:
        return self.num_requests * self.chunks_per_request * self.chunk_bytes

    def request_hashes(self) -> list[list[bytes]]:
        """Fresh random chunk hashes, one list per request."""
        n = self.chunks_per_request
        return [[secrets.token_bytes(32) for _ in range(n)] for _ in range(self.num_requests)]


POOL_BYTES = 128 << 20
"""At least this many bytes of source and destination pages, so that no copy (baseline
included) runs out of the CPU caches when requests are small."""


class Buffers:
    """The engine side: source pages (random bytes) and destination pages, both touched
    before any timing, plus ``shared``: pre-faulted /dev/shm pages like an arena's slots,
    the other end of the baseline copy. Chunk ``k`` of a run uses row ``k % num_rows``."""

    def __init__(self, workload: Workload) -> None:
        cpr = workload.chunks_per_request
        num_chunks = workload.num_requests * cpr
        per_pool = -(-POOL_BYTES // (cpr * workload.chunk_bytes)) * cpr
        self.num_rows = min(num_chunks, per_pool)
        shape = (self.num_rows, workload.chunk_bytes)
        self.src = torch.randint(0, 256, shape, dtype=torch.uint8)
        self.dst = torch.zeros(shape, dtype=torch.uint8)
        self._mm, self.shared = _shared_pages(shape)

    def row(self, request: int, j: int, chunks_per_request: int) -> int:
        return (request * chunks_per_request + j) % self.num_rows

    def clear_dst(self) -> None:
        self.dst.zero_()

    def verified(self) -> bool:
        return bool(torch.equal(self.src, self.dst))


def _shared_pages(shape: tuple[int, int]) -> tuple[mmap.mmap, torch.Tensor]:
    """Zeroed, pre-faulted pages of a /dev/shm file that is unlinked at once (nothing to
    clean up): the same kind of memory as the server's arena."""
    nbytes = shape[0] * shape[1]
    fd, path = tempfile.mkstemp(dir=SHM_DIR, prefix="lmc-bench-copy-")
    try:
        os.unlink(path)
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    try:
        mm.madvise(MADV_POPULATE_WRITE)
    except OSError:  # kernel before 5.14: the fill below touches every page
        pass
    tensor = torch.frombuffer(mm, dtype=torch.uint8).view(shape)
    tensor.zero_()
    return mm, tensor


Direction = Literal["store", "load"]


def time_copy(workload: Workload, bufs: Buffers, direction: Direction) -> float:
    """Seconds for plain torch copies of the same bytes (the baseline): engine source pages
    into shared pages ('store'), or shared pages into engine destination pages ('load')."""
    cpr = workload.chunks_per_request
    start = time.perf_counter()
    for i in range(workload.num_requests):
        for j in range(cpr):
            k = bufs.row(i, j, cpr)
            if direction == "store":
                bufs.shared[k].copy_(bufs.src[k])
            else:
                bufs.dst[k].copy_(bufs.shared[k])
    return time.perf_counter() - start


def _slot(buffer: memoryview) -> torch.Tensor:
    """A slot as a uint8 tensor sharing its memory; leased (read-only) slots are only ever
    copied from, so torch's warning about non-writable buffers is silenced for them (as in
    the plugin's ``KVPages.chunk_tensor``)."""
    if not buffer.readonly:
        return torch.frombuffer(buffer, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        return torch.frombuffer(buffer, dtype=torch.uint8)


def time_shm_store(
    client: CacheClient, ns_id: bytes, requests: list[list[bytes]], bufs: Buffers
) -> float:
    """Per request: prepare_store, copies into the slots, commit_store handed to an I/O
    thread (the plugin's worker commits on its I/O thread too); timed until every commit
    has returned."""
    with ThreadPoolExecutor(1, thread_name_prefix="bench-commit") as io:
        commits: list[Future[int]] = []
        io.submit(int).result()  # the thread exists before the clock starts
        start = time.perf_counter()
        for i, hashes in enumerate(requests):
            slots = client.prepare_store(ns_id, hashes)
            reserved = []
            for j, slot in enumerate(slots):
                if slot.buffer is None:
                    raise RuntimeError(f"prepare_store did not reserve a slot: {slot.status}")
                _slot(slot.buffer).copy_(bufs.src[bufs.row(i, j, len(hashes))])
                reserved.append(slot.chunk_hash)
            commits.append(io.submit(client.commit_store, ns_id, reserved))
        num_committed = sum(f.result() for f in commits)
        elapsed = time.perf_counter() - start
    if num_committed != sum(len(h) for h in requests):
        raise RuntimeError(f"only {num_committed} chunks committed")
    return elapsed


def time_shm_store_pooled(
    client: CacheClient, ns_id: bytes, requests: list[list[bytes]], bufs: Buffers
) -> float:
    """As the plugin's worker stores now: slots taken from a ``StorePool`` (reserved ahead,
    refilled in the background), copies into them, the bind (``CommitStore`` with
    ``reserved_as``) on an I/O thread; a ``prepare_store`` only for slots the pool lacked.
    The pool (two requests' worth, what it keeps after a take of one) is filled once before
    the clock starts (the plugin's is, after its first store); timed until every bind has
    returned."""
    pool = StorePool(client, ns_id, max_slots=2 * max(len(h) for h in requests))
    pool.target = pool.max_slots
    pool.refill()
    num_expected = sum(len(h) for h in requests)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="bench-commit") as io:
            commits: list[Future[int]] = []
            io.submit(int).result()
            start = time.perf_counter()
            for i, hashes in enumerate(requests):
                pooled = pool.take(len(hashes))
                rest = hashes[len(pooled) :]
                slots = [s.buffer for s in pooled]
                if rest:
                    prepared = client.prepare_store(ns_id, rest)
                    if any(p.buffer is None for p in prepared):
                        raise RuntimeError("prepare_store did not reserve every slot")
                    slots += [p.buffer for p in prepared]  # type: ignore[misc]
                for j, buffer in enumerate(slots):
                    _slot(buffer).copy_(bufs.src[bufs.row(i, j, len(hashes))])
                commits.append(io.submit(pool.bind, hashes[: len(pooled)], pooled))
                if rest:
                    commits.append(io.submit(client.commit_store, ns_id, rest))
            num_committed = sum(f.result() for f in commits)
            elapsed = time.perf_counter() - start
    finally:
        pool.close()
    if num_committed != num_expected:
        raise RuntimeError(f"only {num_committed} of {num_expected} chunks committed")
    return elapsed


def time_shm_load(
    client: CacheClient, ns_id: bytes, requests: list[list[bytes]], bufs: Buffers
) -> float:
    """Per request: prepare_load, copies out of the leased slots, release_load handed to an
    I/O thread (as the plugin's worker does); timed until every release has returned."""
    with ThreadPoolExecutor(1, thread_name_prefix="bench-release") as io:
        releases: list[Future[bool]] = []
        io.submit(int).result()  # the thread exists before the clock starts
        start = time.perf_counter()
        for i, hashes in enumerate(requests):
            lease = client.prepare_load(ns_id, hashes)
            try:
                if len(lease.buffers) != len(hashes):
                    raise RuntimeError(f"{len(lease.buffers)} of {len(hashes)} chunks leased")
                for j, buffer in enumerate(lease.buffers):
                    bufs.dst[bufs.row(i, j, len(hashes))].copy_(_slot(buffer))
            finally:
                releases.append(io.submit(client.release_load, lease))
        released = all(f.result() for f in releases)
        elapsed = time.perf_counter() - start
    if not released:
        raise RuntimeError("a lease was not released")
    return elapsed


def _into(dst: torch.Tensor, data: bytes | None) -> None:
    if data is None:
        raise RuntimeError("a stored chunk was not found")
    dst.numpy()[:] = np.frombuffer(data, dtype=np.uint8)


def time_grpc_put(
    client: CacheClient, ns_id: bytes, requests: list[list[bytes]], bufs: Buffers
) -> float:
    start = time.perf_counter()
    for i, hashes in enumerate(requests):
        items = [(h, bufs.src[bufs.row(i, j, len(hashes))].numpy()) for j, h in enumerate(hashes)]
        if client.put(ns_id, items) != len(hashes):
            raise RuntimeError("put stored fewer chunks than sent")
    return time.perf_counter() - start


def time_grpc_get(
    client: CacheClient, ns_id: bytes, requests: list[list[bytes]], bufs: Buffers
) -> float:
    start = time.perf_counter()
    for i, hashes in enumerate(requests):
        for j, data in enumerate(client.get(ns_id, hashes)):
            _into(bufs.dst[bufs.row(i, j, len(hashes))], data)
    return time.perf_counter() - start


def time_rest_put(
    http: httpx.Client, ns_id: bytes, requests: list[list[bytes]], bufs: Buffers
) -> float:
    headers = {"Content-Type": "application/octet-stream"}
    start = time.perf_counter()
    for i, hashes in enumerate(requests):
        for j, h in enumerate(hashes):
            url = f"/v1/chunks/{ns_id.hex()}/{h.hex()}"
            data = bufs.src[bufs.row(i, j, len(hashes))].numpy().tobytes()
            resp = http.put(url, content=data, headers=headers)
            if resp.status_code not in (200, 201):
                raise RuntimeError(f"PUT {url}: {resp.status_code} {resp.text[:200]}")
    return time.perf_counter() - start


def time_rest_get(
    http: httpx.Client, ns_id: bytes, requests: list[list[bytes]], bufs: Buffers
) -> float:
    start = time.perf_counter()
    for i, hashes in enumerate(requests):
        for j, h in enumerate(hashes):
            resp = http.get(f"/v1/chunks/{ns_id.hex()}/{h.hex()}")
            if resp.status_code != 200:
                raise RuntimeError(f"GET chunk: {resp.status_code} {resp.text[:200]}")
            _into(bufs.dst[bufs.row(i, j, len(hashes))], resp.content)
    return time.perf_counter() - start

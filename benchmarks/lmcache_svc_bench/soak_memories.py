"""Named memories in ``bench soak``: uploads, reads, lists and deletes under the same faults,
plus memory files corrupted on disk, every byte of every read verified.

Memory ``i`` of the key space has a fixed id and fixed bytes (``memory_id``, ``memory_blob``:
a small safetensors blob whose data is a pattern seeded by ``i``), so any read is checked on
the spot with no bookkeeping. A worker (``soak_worker.py --memories grpc|rest``) mixes puts,
reads, lists and deletes over gRPC (``CacheClient``) or REST (httpx, streamed reads). A read
may answer the memory's exact bytes, "no such memory" (deleted, or quarantined), or
``memory_corrupted`` (its file was corrupted on disk: refused, never served); any other bytes
are a mismatch, and a mismatch fails the run. ``MemoryFaults`` flips a byte of a random
memory file every few seconds and plants files that are not memories (a 5,000-digit integer,
deep nesting, garbage) before the server restarts, which must still start.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from lmcache_svc import errors
from lmcache_svc.client import CacheClient
from lmcache_svc.wire import error_from_kind

MEMORY_OPS = ("mem_put", "mem_get", "mem_list", "mem_delete")
_WEIGHTS = (3, 5, 1, 1)


def memory_id(index: int) -> str:
    digest = hashlib.sha256(f"soak-memory-{index}".encode()).digest()
    return str(uuid.UUID(bytes=digest[:16], version=4))


def memory_blob(index: int) -> bytes:
    """Memory ``index``'s bytes: one U8 tensor of 64-320 KiB seeded by the index."""
    rng = np.random.default_rng(index)
    data = rng.bytes(int(rng.integers(64, 321)) * 1024)
    header = {
        "t": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]},
        "__metadata__": {
            "lmcache_svc.memory_format": "1",
            "memory_id": memory_id(index),
            "model": "soak",
            "metadata": json.dumps({"index": index}),
        },
    }
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


class MemoryWorker:
    """One worker's memory operations over ``transport`` ("grpc" or "rest")."""

    def __init__(
        self, transport: str, client: CacheClient, http_url: str, key_space: int, tally: Any
    ) -> None:
        self.transport = transport
        self.client = client
        self.http = httpx.Client(base_url=http_url, timeout=30)
        self.key_space = key_space
        self.tally = tally
        self.rng = random.Random()

    def step(self) -> None:
        index = self.rng.randrange(self.key_space)
        op = self.rng.choices(MEMORY_OPS, _WEIGHTS)[0]
        if op == "mem_put":
            self._put(memory_blob(index))
        elif op == "mem_get":
            self.verify(index, self._get(memory_id(index)))
        elif op == "mem_list":
            self._list()
        else:
            self._delete(memory_id(index))
        self.tally.add(op)

    def verify(self, index: int, blob: bytes | None) -> None:
        if blob is None:
            return
        if blob == memory_blob(index):
            self.tally.add("mem_bytes_verified", len(blob))
        else:
            self.tally.add("mem_mismatches")
            self.tally.mismatched.append(f"memory {memory_id(index)} ({len(blob)} bytes)")

    def _put(self, blob: bytes) -> None:
        if self.transport == "grpc":
            self.client.put_memory(blob)
            return
        _check(self.http.post("/v1/memories", content=blob), 200, 201)

    def _get(self, mid: str) -> bytes | None:
        try:
            if self.transport == "grpc":
                return self.client.get_memory(mid)
            with self.http.stream("GET", f"/v1/memories/{mid}") as r:
                if r.status_code == 404:
                    return None
                if r.status_code != 200:
                    r.read()
                _check(r, 200)
                return b"".join(r.iter_bytes())
        except errors.MemoryCorrupted:
            self.tally.add("mem_corrupted_refused")  # refused, never served: as designed
            return None

    def _list(self) -> None:
        if self.transport == "grpc":
            self.client.list_memories()
        else:
            _check(self.http.get("/v1/memories"), 200)

    def _delete(self, mid: str) -> None:
        if self.transport == "grpc":
            self.client.delete_memory(mid)
        else:
            _check(self.http.delete(f"/v1/memories/{mid}"), 204, 404)

    def close(self) -> None:
        self.http.close()


def _check(r: httpx.Response, *ok: int) -> None:
    """Raise the project's error for a REST error body (counted by the worker by kind)."""
    if r.status_code in ok:
        return
    try:
        body = r.json()
        kind, message = body["error"], body["message"]
    except (ValueError, KeyError, TypeError):
        raise errors.LMCacheSvcError(f"HTTP {r.status_code}") from None
    raise error_from_kind(kind, message)


class MemoryFaults:
    """Corrupts memory files on disk while the run goes on, and plants bad files."""

    def __init__(self, memory_dir: Path, events: list[tuple[float, str]]) -> None:
        self.memory_dir = memory_dir
        self.events = events
        self.corrupted = 0
        self._rng = random.Random(1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, every_s: tuple[float, float] = (1.0, 2.5)) -> None:
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: tuple[float, float]) -> None:
        while not self._stop.wait(self._rng.uniform(*every_s)):
            if self.corrupt_one():
                self.events.append((time.time(), "memory file corrupted"))

    def corrupt_one(self) -> bool:
        files = sorted(self.memory_dir.glob("t-*/*.safetensors"))
        if not files:
            return False
        file = self._rng.choice(files)
        try:
            with open(file, "r+b") as f:
                size = f.seek(0, 2)
                offset = self._rng.randrange(size)
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0x40]))
        except (OSError, IndexError, ValueError):
            return False  # deleted or quarantined meanwhile
        self.corrupted += 1
        return True

    def plant_bad_files(self) -> int:
        """Files that are not memories, for the next start-up to skip (it must start)."""
        tenant_dir = self.memory_dir / ("t-" + b"default".hex())
        tenant_dir.mkdir(parents=True, exist_ok=True)
        bad = {
            b'{"t": [' + b"9" * 5000 + b"]}",
            b'{"t": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        }
        planted = 0
        for i, header in enumerate(sorted(bad)):
            name = f"{uuid.UUID(int=i + 1, version=4)}.safetensors"
            (tenant_dir / name).write_bytes(struct.pack("<Q", len(header)) + header)
            planted += 1
        garbage = f"{uuid.UUID(int=99, version=4)}.safetensors"
        (tenant_dir / garbage).write_bytes(self._rng.randbytes(4096))
        return planted + 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


def final_memory_check(socket: str, key_space: int) -> dict[str, int]:
    """Read every memory the server lists and check its bytes (corrupted ones are refused)."""
    found = verified = mismatches = refused = 0
    with CacheClient(socket, timeout_s=30, use_shm=False) as c:
        listed = {info.memory_id for info in c.list_memories()}
        for index in range(key_space):
            mid = memory_id(index)
            if mid not in listed:
                continue
            found += 1
            try:
                blob = c.get_memory(mid)
            except errors.MemoryCorrupted:
                refused += 1
                continue
            if blob == memory_blob(index):
                verified += len(blob)
            elif blob is not None:
                mismatches += 1
    return {"memories": found, "bytes_verified": verified, "mismatches": mismatches,
            "corrupted_refused": refused}  # fmt: skip

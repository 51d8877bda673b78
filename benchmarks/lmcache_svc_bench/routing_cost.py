"""The events' cost on the store path: two servers, one with events on (a subscriber
reading its stream) and one with them off, the same stores through a same-host client
(prepare, copy into the shared segment, commit with the chunks' token ids), rounds
interleaved; the median time per chunk of each, in one run."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq

from lmcache_svc.client import CacheClient
from lmcache_svc.client.events import ChunkTokens
from lmcache_svc.keys import KVLayout, Namespace, chunk_hashes
from lmcache_svc_bench.procs import ServerProc, start_server

EVENTS_ENV = {
    "LMCACHE_SVC_EVENTS__ENABLED": "true",
    "LMCACHE_SVC_EVENTS__ENDPOINT": "tcp://127.0.0.1:0",
    "LMCACHE_SVC_EVENTS__REPLAY_ENDPOINT": "tcp://127.0.0.1:0",
}


@dataclass(frozen=True)
class StoreCost:
    chunk_bytes: int
    chunks_per_store: int
    rounds: int
    off_us_per_chunk: float
    on_us_per_chunk: float
    events_received: int

    @property
    def overhead(self) -> float:
        return self.on_us_per_chunk / self.off_us_per_chunk - 1


def namespace(chunk_tokens: int) -> Namespace:
    """The tiny bench model's layout (2 KiB of KV per token)."""
    layout = KVLayout("bfloat16", 4, 2, 64, chunk_tokens, "bench")
    return Namespace(model="routing-cost", layout=layout, chunk_size=chunk_tokens)


def measure(work_dir: Path, *, rounds: int, chunks_per_store: int = 8) -> StoreCost:
    ns = namespace(128)
    servers: dict[str, ServerProc] = {}
    try:
        servers["off"] = start_server(work_dir, "--cpu-bytes", "512MiB", "--prefault", "sync")
        servers["on"] = start_server(
            work_dir, "--cpu-bytes", "512MiB", "--prefault", "sync", env=EVENTS_ENV
        )
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(servers["on"].ready["events"])
        times: dict[str, list[float]] = {"off": [], "on": []}
        received = 0
        clients = {k: CacheClient(s.socket, timeout_s=10) for k, s in servers.items()}
        try:
            ids = {k: c.register_namespace(ns) for k, c in clients.items()}
            payload = np.random.default_rng(0).integers(0, 255, ns.chunk_bytes, dtype=np.uint8)
            for r in range(rounds):
                tokens = np.random.default_rng(r + 1).integers(
                    0, 30_000, chunks_per_store * ns.chunk_size
                )
                hashes = chunk_hashes(ns, tokens)
                described = ChunkTokens()
                for i, h in enumerate(hashes):
                    part = tokens[i * ns.chunk_size : (i + 1) * ns.chunk_size]
                    described.add(h, hashes[i - 1] if i else b"", part.astype("<u4").tobytes())
                order = ("off", "on") if r % 2 else ("on", "off")
                for key in order:
                    client = clients[key]
                    start = time.perf_counter()
                    slots = client.prepare_store(ids[key], hashes)
                    for slot in slots:
                        if slot.buffer is not None:
                            np.frombuffer(slot.buffer, dtype=np.uint8)[:] = payload
                    client.commit_store(ids[key], hashes, described=described)
                    times[key].append((time.perf_counter() - start) / chunks_per_store)
                while sub.poll(0):
                    sub.recv_multipart()
                    received += 1
        finally:
            for client in clients.values():
                client.close()
            sub.close(linger=0)
            ctx.term()
        return StoreCost(
            ns.chunk_bytes,
            chunks_per_store,
            rounds,
            statistics.median(times["off"]) * 1e6,
            statistics.median(times["on"]) * 1e6,
            received,
        )
    finally:
        for server in servers.values():
            server.cleanup()

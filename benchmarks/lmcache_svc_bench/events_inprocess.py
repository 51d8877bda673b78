"""The events' cost on the server's store path, in process (no client, no sockets but the
publisher's): ``prepare_store`` + ``commit_store`` of chunks with their token ids, on a
cache with the node event stream and on one without, rounds interleaved.

Measured as CPU time, not wall time (the machines this runs on are often shared):

- the caller's thread (``time.thread_time_ns``) per chunk: min, lower quartile and median
  over rounds (the lower quartile is the steadiest on a busy machine);
- the publisher thread's CPU per chunk (its thread clock over the whole run, once it has
  sent everything): the work that competes with the store path for the GIL.

With ``--paused`` the publisher thread is held before it flushes, and its work (a flush,
then encoding the batch) is done on this thread after every ``FLUSH_EVERY`` rounds, timed
apart: the caller's figures are the store path alone, the publisher's its work alone,
neither inflated by the two threads trading the GIL.

Run: ``python -m lmcache_svc_bench.events_inprocess [--rounds N] [--chunks-per-store K]
[--paused]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.keys import KVLayout, Namespace, chunk_hashes
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.events import publisher as publisher_module
from lmcache_svc.server.events.metrics import EventMetrics
from lmcache_svc.server.events.node_stream import NodeEvents
from lmcache_svc.server.events.settings import EventsSettings
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.cpu import CpuTier


@dataclass(frozen=True)
class Cost:
    """Nanoseconds of CPU per chunk."""

    off: tuple[float, float, float]
    """Caller's thread, events off: min, lower quartile, median."""
    on: tuple[float, float, float]
    publisher: float
    """The publisher thread, per chunk stored with events on."""

    def lines(self) -> list[str]:
        def row(what: str, q: tuple[float, float, float]) -> str:
            us = [f"{v / 1e3:.2f}" for v in q]
            return f"{what}: min {us[0]} us/chunk, q1 {us[1]}, median {us[2]}"

        off_q1, on_q1 = self.off[1], self.on[1]
        return [
            row("caller thread, events off", self.off),
            row("caller thread, events on ", self.on),
            f"caller overhead (q1): {on_q1 - off_q1:+.0f} ns/chunk, {on_q1 / off_q1 - 1:+.1%}",
            f"publisher thread: {self.publisher / 1e3:.2f} us/chunk",
            f"caller + publisher vs off (q1): {(on_q1 + self.publisher) / off_q1 - 1:+.1%}",
        ]


def namespace(chunk_tokens: int) -> Namespace:
    """Small chunks (4 KiB for 256 tokens): the cost measured is the bookkeeping, not the bytes."""
    layout = KVLayout("bfloat16", 1, 1, 4, 16, "bench")
    return Namespace(model="events-cost", layout=layout, chunk_size=chunk_tokens)


def _cache(ns: Namespace, num_chunks: int, listener: NodeEvents | None) -> TieredCache:
    arena = Arena.create(2 * num_chunks * ns.chunk_bytes, slab_bytes=1 << 20, prefault="sync")
    settings = CacheSettings(max_chunks_per_request=4096)
    cache = TieredCache(CpuTier(arena), settings=settings, listener=listener)
    cache.register_namespace(ns)
    return cache


def _publisher_cpu_ns(node: NodeEvents) -> int:
    thread = next(t for t in threading.enumerate() if t.name == "events-pub")
    assert thread.ident is not None
    return time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))


def _publisher_work_ns(node: NodeEvents) -> int:
    """Thread CPU time of the held publisher's work, done here: a flush and the encoding of
    every batch it numbered (the publisher then sends the payloads as they are)."""
    start = time.thread_time_ns()
    with node._lock:
        node._log.flush()
        batches = node._log.since(node.publisher._last_sent + 1)
    for batch in batches:
        batch.encoded()
    return time.thread_time_ns() - start


def _drain(node: NodeEvents) -> None:
    """Wait until the publisher sent everything queued."""
    while True:
        with node._lock:
            done = not node._log.ready and node.publisher._last_sent >= node._log.next_seq - 1
        if done:
            return
        time.sleep(0.01)


FLUSH_EVERY = 8
"""Rounds between two flushes of the held publisher (``--paused``): batches of about the
size the publisher's linger gathers."""


class _Gate:
    """Stands in for the publisher module's ``time``: ``sleep`` (the publisher's linger
    before a flush) waits while the gate is closed."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()

    def sleep(self, seconds: float) -> None:
        self.open.wait()
        time.sleep(seconds)

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def measure(
    rounds: int, chunks_per_store: int, chunk_tokens: int = 256, *, paused: bool = False
) -> Cost:
    ns = namespace(chunk_tokens)
    total = rounds * chunks_per_store
    work: list[tuple[list[bytes], bytes, list[bytes]]] = []
    for r in range(rounds):
        tokens = np.random.default_rng(r).integers(0, 150_000, chunks_per_store * chunk_tokens)
        hashes: list[bytes] = list(chunk_hashes(ns, tokens))
        work.append((hashes, tokens.astype("<u4").tobytes(), [b"", *hashes[:-1]]))
    with tempfile.TemporaryDirectory() as tmp:
        settings = EventsSettings(
            enabled=True,
            endpoint=f"ipc://{tmp}/pub",
            replay_endpoint=None,
            node="bench",
            max_pending=max(100_000, 4 * total),
        )
        gate = _Gate()
        publisher_module.time = gate  # type: ignore[assignment]
        node = NodeEvents(settings, EventMetrics(Metrics().registry))
        caches = {"off": _cache(ns, total, None), "on": _cache(ns, total, node)}
        times: dict[str, list[int]] = {"off": [], "on": []}
        try:
            _drain(node)
            pub_start = _publisher_cpu_ns(node)
            publisher = 0
            if paused:
                gate.open.clear()
            for r, (hashes, token_ids, parents) in enumerate(work):
                for mode in ("off", "on") if r % 2 else ("on", "off"):
                    cache = caches[mode]
                    start = time.thread_time_ns()
                    cache.prepare_store(ns.namespace_id, hashes)
                    cache.commit_store(
                        ns.namespace_id, hashes, token_ids=token_ids, parent_hashes=parents
                    )
                    times[mode].append(time.thread_time_ns() - start)
                if paused and (r % FLUSH_EVERY == FLUSH_EVERY - 1 or r == rounds - 1):
                    publisher += _publisher_work_ns(node)
            gate.open.set()
            _drain(node)
            if not paused:
                publisher = _publisher_cpu_ns(node) - pub_start
        finally:
            gate.open.set()
            for cache in caches.values():
                cache.close()
            node.close()
            publisher_module.time = time
    per = {k: [t / chunks_per_store for t in v] for k, v in times.items()}
    return Cost(_quantiles(per["off"]), _quantiles(per["on"]), publisher / total)


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, _ = statistics.quantiles(values, n=4)
    return min(values), q1, median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--chunks-per-store", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--paused", action="store_true", help="hold the publisher meanwhile")
    args = parser.parse_args()
    cost = measure(args.rounds, args.chunks_per_store, args.chunk_tokens, paused=args.paused)
    print("\n".join(cost.lines()))


if __name__ == "__main__":
    main()

"""``python -m lmcache_svc_bench.checksum``: what an xxh3-64 checksum of an arena chunk costs
next to a memcpy of the same bytes (the copy a client makes to store or load it).

Both run over warm, pre-faulted buffers, one thread, ``--repeat`` times per size; the median
throughput is printed as one JSON line per size. Then the store path of an in-process
``TieredCache`` (prepare, copy into the slot, commit; what a same-host client's store costs
the server and the client together) with checksums off, with them taken in the background
(the design), and with xxh3 run inline at each commit (the alternative). Used to decide
where the arena's chunk checksums are computed and verified (docs/architecture.md,
"Chunk checksums").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import xxhash

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.keys import KVLayout, Namespace
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.cpu import CpuTier

MIB = 1 << 20
STORE_BYTES = 256 * MIB


def _median_s(fn: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(size: int, repeat: int) -> dict[str, float | int]:
    src = bytearray(size)
    src[::4096] = b"\x01" * len(src[::4096])
    dst = memoryview(bytearray(size))
    view = memoryview(src)
    dst[:] = view  # warm both

    def copy() -> None:
        dst[:] = view

    def checksum() -> None:
        xxhash.xxh3_64_intdigest(view)

    copy_s, hash_s = _median_s(copy, repeat), _median_s(checksum, repeat)
    return {
        "chunk_mib": size // MIB,
        "memcpy_gb_s": round(size / copy_s / 1e9, 2),
        "xxh3_gb_s": round(size / hash_s / 1e9, 2),
        "memcpy_ms": round(copy_s * 1e3, 3),
        "xxh3_ms": round(hash_s * 1e3, 3),
        "xxh3_over_memcpy": round(hash_s / copy_s, 2),
    }


def _namespace(size: int) -> Namespace:
    layout = KVLayout(
        "uint8",
        num_layers=1,
        num_kv_heads=1,
        head_size=size // 512,
        block_size=256,
        page_layout="bench",
    )  # K and V planes: 2 x 256 x head
    ns = Namespace(model="bench-checksum", layout=layout, chunk_size=256)
    assert ns.chunk_bytes == size, (ns.chunk_bytes, size)
    return ns


def _store_ms(
    cache: TieredCache, ns: Namespace, src: memoryview, rounds: int, inline_hash: bool
) -> tuple[float, float]:
    """Median wall time per chunk of storing STORE_BYTES as chunks of ``src``'s size (the
    request path), and of waiting for the background work (checksums) to finish after it."""
    num = STORE_BYTES // len(src)
    stores, drains = [], []
    for r in range(rounds):
        hashes = [xxhash.xxh3_128_digest(f"{r}-{i}".encode()) * 2 for i in range(num)]
        start = time.perf_counter()
        for chunk_hash in hashes:
            (p,) = cache.prepare_store(ns.namespace_id, [chunk_hash], session_id="bench")
            assert p.slot is not None, "bench arena too small"
            view = cache.view(p.slot)
            view[:] = src
            if inline_hash:
                xxhash.xxh3_64_intdigest(view)
            cache.commit_store(ns.namespace_id, [chunk_hash], session_id="bench")
        stored = time.perf_counter()
        assert cache.flush(60)
        stores.append((stored - start) / num)
        drains.append((time.perf_counter() - stored) / num)
        cache.delete(ns.namespace_id, hashes)
    return statistics.median(stores) * 1e3, statistics.median(drains) * 1e3


def measure_store(size: int, rounds: int) -> dict[str, float | int]:
    ns = _namespace(size)
    src = memoryview(bytearray(b"\x5a" * size))
    out: dict[str, float | int] = {"chunk_mib": size // MIB}
    for label, checksums, inline in (
        ("off", False, False),
        ("background", True, False),
        ("inline", False, True),
    ):
        arena = Arena.create(
            STORE_BYTES + 2 * size, slab_bytes=max(size, 64 * MIB), prefault="sync"
        )
        settings = CacheSettings(checksums=checksums, max_reserved_fraction=1.0, high_watermark=1.0)
        cache = TieredCache(CpuTier(arena), settings=settings)
        cache.register_namespace(ns)
        cache.start()
        try:
            store_ms, drain_ms = _store_ms(cache, ns, src, rounds, inline)
            out[f"store_ms_{label}"] = round(store_ms, 3)
            if label == "background":
                out["background_drain_ms"] = round(drain_ms, 3)
        finally:
            cache.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--store-rounds", type=int, default=5)
    args = parser.parse_args()
    print(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "xxhash": xxhash.VERSION,
            }
        )
    )
    for mib in args.sizes_mib:
        print(json.dumps(measure(mib * MIB, args.repeat)))
    for mib in args.sizes_mib:
        print(json.dumps(measure_store(mib * MIB, args.store_rounds)))


if __name__ == "__main__":
    main()

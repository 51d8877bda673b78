"""``python -m lmcache_svc.bench.checksum``: what an xxh3-64 checksum of an arena chunk costs
next to a memcpy of the same bytes (the copy a client makes to store or load it).

Both run over warm, pre-faulted buffers, one thread, ``--repeat`` times per size; the median
throughput is printed as one JSON line per size. Used to decide where the arena's chunk
checksums are computed and verified (docs/architecture.md, "Chunk checksums").
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import xxhash

MIB = 1 << 20


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--repeat", type=int, default=21)
    args = parser.parse_args()
    print(json.dumps({"machine": platform.processor() or platform.machine(),
                      "xxhash": xxhash.VERSION}))
    for mib in args.sizes_mib:
        print(json.dumps(measure(mib * MIB, args.repeat)))


if __name__ == "__main__":
    main()

"""One soak client process: store, load and look up chunks whose bytes derive from their keys.

``python -m lmcache_svc_bench.soak_worker --address A --name N --out F --until T [--inline]``

Every chunk's bytes are a seeded pattern of its hash (``content``), so any load is verified
on the spot with no bookkeeping: a mismatch is a chunk served with bytes that were never
stored under its key. Counts go to ``--out`` (JSON, rewritten atomically every second, so a
killed worker loses at most its last second) per wall-clock second: operations by kind,
errors by kind, bytes verified, mismatches. Errors (server restarting, timeouts) are counted
and retried after a short pause; they are expected while faults are injected.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from lmcache_svc.client import CacheClient
from lmcache_svc.keys import KVLayout, Namespace, chunk_hashes

_OPS = ("store", "load", "lookup", "delete")
_WEIGHTS = (3, 4, 2, 1)
CHUNKS_PER_PREFIX = 4
TOKENS_PER_PREFIX = 4096  # distinct token ranges per prefix id


def soak_namespace() -> Namespace:
    layout = KVLayout(
        "uint8", num_layers=1, num_kv_heads=1, head_size=128, block_size=16, page_layout="soak"
    )
    return Namespace(model="soak", layout=layout, chunk_size=256, tenant="soak")  # 64 KiB


def content(chunk_hash: bytes, nbytes: int) -> bytes:
    """The bytes stored under a chunk: a pattern seeded by its hash."""
    seed = int.from_bytes(chunk_hash[:16], "little")
    return np.random.default_rng(seed).bytes(nbytes)


def prefix_hashes(ns: Namespace, prefix: int) -> list[bytes]:
    start = prefix * TOKENS_PER_PREFIX
    tokens = list(range(start, start + CHUNKS_PER_PREFIX * ns.chunk_size))
    return [bytes(h) for h in chunk_hashes(ns, tokens)]


class Tally:
    """Counts per wall-clock second, written to a JSON file."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.seconds: dict[int, Counter[str]] = defaultdict(Counter)
        self.mismatched: list[str] = []
        self.details: list[dict[str, Any]] = []
        self.error_samples: list[str] = []
        self._flushed = time.time()

    def add(self, what: str, num: int = 1) -> None:
        self.seconds[int(time.time())][what] += num

    def flush(self, force: bool = False) -> None:
        if not force and time.time() - self._flushed < 1.0:
            return
        data = {"seconds": {str(k): dict(v) for k, v in self.seconds.items()},
                "mismatched": self.mismatched[:50], "details": self.details[:50],
                "error_samples": self.error_samples[:20]}  # fmt: skip
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.out)
        self._flushed = time.time()


class Worker:
    def __init__(
        self, client: CacheClient, inline: bool, store_only: bool, key_space: int, tally: Tally
    ) -> None:
        self.client = client
        self.inline = inline
        self.store_only = store_only
        self.key_space = key_space
        self.tally = tally
        self.ns = soak_namespace()
        self.ns_id = client.register_namespace(self.ns)
        self.rng = random.Random(os.getpid())

    def step(self) -> None:
        hashes = prefix_hashes(self.ns, self.rng.randrange(self.key_space))
        op = "store" if self.store_only else self.rng.choices(_OPS, _WEIGHTS)[0]
        if op == "store":
            data = [content(h, self.ns.chunk_bytes) for h in hashes]
            if self.inline:
                self.client.put(self.ns_id, list(zip(hashes, data)))
            else:
                self.client.store(self.ns_id, hashes, data)
        elif op == "load":
            for h, chunk in zip(hashes, self._load(hashes)):
                if chunk is not None:
                    self.verify(h, chunk)
        elif op == "lookup":
            self.client.lookup(self.ns_id, hashes)
        else:  # keeps stores writing new chunks once the whole key space has been stored
            self.client.delete(self.ns_id, hashes)
        self.tally.add(op)

    def _load(self, hashes: list[bytes]) -> list[bytes | None]:
        """Each chunk's bytes in order, None where missing (inline Get answers every chunk;
        a shared-memory load, the longest available prefix)."""
        if self.inline:
            return self.client.get(self.ns_id, hashes)
        return list(self.client.load(self.ns_id, hashes))

    def verify(self, chunk_hash: bytes, chunk: bytes) -> None:
        if chunk == content(chunk_hash, self.ns.chunk_bytes):
            self.tally.add("bytes_verified", len(chunk))
        else:
            self.tally.add("mismatches")
            self.tally.mismatched.append(chunk_hash.hex())
            detail = _describe(chunk_hash, chunk, self.ns.chunk_bytes, self.inline)
            self.tally.details.append(detail)


def run(args: argparse.Namespace) -> None:
    tally = Tally(Path(args.out))
    client = CacheClient(args.address, timeout_s=args.timeout_s, use_shm=not args.inline)
    worker: Worker | None = None
    ops = 0
    while time.time() < args.until and ops < args.max_ops:
        try:
            if worker is None:
                worker = Worker(client, args.inline, args.store_only, args.key_space, tally)
            worker.step()
            ops += 1
        except Exception as e:  # faults are injected: count the error, pause, go on
            tally.add(f"error:{_kind(e)}")
            tally.error_samples.append(f"{time.time():.1f} {type(e).__name__}: {e}"[:300])
            time.sleep(0.1)
        tally.flush()
    tally.flush(force=True)
    client.close()


def _describe(chunk_hash: bytes, chunk: bytes, nbytes: int, inline: bool) -> dict[str, Any]:
    """What a wrong chunk looks like, to tell torn writes from another key's bytes."""
    want = np.frombuffer(content(chunk_hash, nbytes), np.uint8)
    got = np.frombuffer(chunk, np.uint8)
    if len(got) != len(want):
        return {"hash": chunk_hash.hex(), "size": len(got), "inline": inline}
    diff = np.flatnonzero(got != want)
    return {
        "hash": chunk_hash.hex(), "inline": inline, "time": time.time(),
        "first_diff": int(diff[0]), "last_diff": int(diff[-1]), "num_diff": int(len(diff)),
        "zeros_in_diff": int((got[diff] == 0).sum()),
    }  # fmt: skip


def _kind(error: Exception) -> str:
    kind: Any = getattr(error, "kind", None)
    return str(kind) if kind else type(error).__name__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--until", type=float, required=True, help="wall-clock end (epoch s)")
    parser.add_argument("--max-ops", type=int, default=1_000_000)
    parser.add_argument("--key-space", type=int, default=600)
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--inline", action="store_true", help="inline gRPC, no shared memory")
    parser.add_argument("--store-only", action="store_true", help="only stores (a kill victim)")
    run(parser.parse_args())


if __name__ == "__main__":
    main()

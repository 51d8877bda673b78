"""The SSD tier of a real server killed (SIGKILL) during write-through, or stopped (SIGTERM).

Chunk bytes are derived from the chunk hash, so whatever a restarted server serves can be
checked without bookkeeping: it is either exactly what was stored, or a miss.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from lmcache_svc.client import CacheClient
from lmcache_svc.keys import chunk_hashes
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.helpers import wait_until
from tests.server.test_grpc import NS
from tests.tiers.fault_helpers import tier_stats

WRITE_THROUGH = {"LMCACHE_SVC_SSD__WRITE_THROUGH": "true"}


def content(chunk_hash: bytes) -> bytes:
    return hashlib.sha256(chunk_hash).digest() * (NS.chunk_bytes // 32)


def ssd_server(tmp_path: Path, ssd: Path) -> ServerProc:
    return start_server(
        tmp_path, "--cpu-bytes", "64MiB", "--ssd-path", str(ssd), "--ssd-bytes", "1GiB",
        env=WRITE_THROUGH,
    )  # fmt: skip


def store(server: ServerProc, first: int, num: int) -> list[bytes]:
    hashes = [bytes(h) for h in chunk_hashes(NS, list(range(first * 256, (first + num) * 256)))]
    with CacheClient(server.socket, timeout_s=30) as c:
        ns_id = c.register_namespace(NS)
        for i in range(0, num, 8):
            batch = hashes[i : i + 8]
            assert c.store(ns_id, batch, [content(h) for h in batch]) == len(batch)
    return hashes


def load_each(server: ServerProc, hashes: list[bytes]) -> dict[bytes, bytes | None]:
    """Each chunk loaded on its own (a miss does not hide the chunks after it)."""
    out: dict[bytes, bytes | None] = {}
    with CacheClient(server.socket, timeout_s=30) as c:
        ns_id = c.register_namespace(NS)
        for h in hashes:
            got = c.load(ns_id, [h])
            out[h] = got[0] if got else None
    return out


def chunk_file(ssd: Path, chunk_hash: bytes) -> Path:
    name = (NS.namespace_id + chunk_hash).hex()
    return ssd / "chunks" / name[:2] / f"{name}.kv"


def test_sigkill_during_write_through_serves_only_whole_chunks(tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    first = ssd_server(tmp_path, ssd)
    try:
        durable = store(first, 0, 48)
        wait_until(lambda: tier_stats(first, "ssd")["num_chunks"] >= 48, 60, "write-through")
        # Heavy write-through in flight when the server is killed.
        stop = threading.Event()
        in_flight: list[bytes] = []

        def writer() -> None:
            n = 1000
            while not stop.is_set():
                try:
                    in_flight.extend(store(first, n, 8))
                except Exception:  # the server was killed under it
                    return
                n += 8

        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        wait_until(lambda: len(in_flight) >= 64, 60, "writes in flight")
        first.proc.kill()
        first.proc.wait()
        stop.set()
        thread.join(30)
    finally:
        first.cleanup()

    # Torn and corrupted files next to the good ones, as a crash or a bad disk leaves them.
    truncated, flipped = durable[0], durable[1]
    path = chunk_file(ssd, truncated)
    path.write_bytes(path.read_bytes()[: 4096 + NS.chunk_bytes // 2])
    path = chunk_file(ssd, flipped)
    raw = bytearray(path.read_bytes())
    raw[4096 + 100] ^= 0xFF
    path.write_bytes(bytes(raw))
    (ssd / "tmp" / "leftover.tmp").write_bytes(b"half a chunk")

    second = ssd_server(tmp_path, ssd)
    try:
        assert not chunk_file(ssd, truncated).exists(), "a truncated file was kept"
        assert list((ssd / "tmp").iterdir()) == [], "tmp leftovers were kept"
        got = load_each(second, durable + in_flight)
        wrong = [h.hex()[:12] for h, data in got.items() if data is not None and data != content(h)]
        assert wrong == [], f"served bytes that differ from what was stored: {wrong}"
        assert got[truncated] is None and got[flipped] is None
        assert not chunk_file(ssd, flipped).exists(), "a corrupted file was kept after its read"
        lost = [h for h in durable[2:] if got[h] is None]
        assert lost == [], f"{len(lost)} chunks written through before the kill were lost"
        assert any(got[h] is not None for h in in_flight)  # some of the heavy batch made it
    finally:
        second.cleanup()


def test_sigterm_keeps_every_committed_chunk(tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    first = ssd_server(tmp_path, ssd)
    try:
        hashes = store(first, 0, 96)  # no wait: SIGTERM must finish the queued write-through
        with CacheClient(first.socket, timeout_s=30) as open_session:
            ns_id = open_session.register_namespace(NS)
            open_session.store(ns_id, hashes[:1], [content(hashes[0])])
            assert first.stop() == 0  # its session stream ends while the server drains
        assert "Traceback" not in first.log(), first.log()[-3000:]
    finally:
        first.cleanup()
    second = ssd_server(tmp_path, ssd)
    try:
        assert tier_stats(second, "ssd")["num_chunks"] == 96
        got = load_each(second, hashes)
        assert all(got[h] == content(h) for h in hashes)
    finally:
        second.cleanup()

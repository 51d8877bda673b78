"""SsdTier: file format, capacity, restart, corruption and O_DIRECT."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from lmcache_svc.errors import ConfigError, Corrupted, InvalidArgument, TierError
from lmcache_svc.keys import ChunkKey
from lmcache_svc.tiers import ssd
from lmcache_svc.tiers.base import Failed
from lmcache_svc.tiers.ssd import BLOCK, SsdTier
from tests.helpers import make_chunk, make_key

MiB = 1 << 20
CHUNK = 1000  # bytes: not a multiple of the 4 KiB block


def chunk_path(root: Path, key: ChunkKey) -> Path:
    return root / "chunks" / key.hex()[:2] / f"{key.hex()}.kv"


def read(tier: SsdTier, key: ChunkKey) -> bytes | None:
    return tier.get(key)


def files_on_disk(root: Path) -> list[Path]:
    return sorted((root / "chunks").rglob("*.kv"))


def test_round_trip(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, 10 * MiB)
    key, data = make_key(1), make_chunk(1, 5000)

    assert tier.put(key, data)

    assert tier.size_of(key) == 5000
    assert tier.contains_many([key, make_key(2)]) == [True, False]
    out = bytearray(5000)
    assert tier.read_into(key, memoryview(out))
    assert bytes(out) == data
    assert tier.used_bytes == BLOCK + 5000 == chunk_path(tmp_path, key).stat().st_size
    assert tier.num_chunks == 1
    assert list(tier.scan()) == [(key, 5000)]
    assert os.listdir(tmp_path / "tmp") == []


def test_absent_key_misses(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, MiB)
    assert tier.size_of(make_key(1)) is None
    assert not tier.read_into(make_key(1), memoryview(bytearray(10)))
    assert tier.get(make_key(1)) is None


def test_overwrite_replaces_bytes_and_accounting(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, MiB)
    key = make_key(1)
    tier.put(key, make_chunk(1, 100))

    assert tier.put(key, make_chunk(2, 300))

    assert read(tier, key) == make_chunk(2, 300)
    assert tier.used_bytes == BLOCK + 300
    assert tier.num_chunks == 1
    assert files_on_disk(tmp_path) == [chunk_path(tmp_path, key)]


def test_delete_frees_bytes(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, MiB)
    key = make_key(1)
    tier.put(key, make_chunk(1, 100))

    assert tier.delete(key) == BLOCK + 100

    assert tier.used_bytes == 0
    assert tier.num_chunks == 0
    assert not chunk_path(tmp_path, key).exists()
    assert tier.delete(key) == 0
    assert not tier.read_into(key, memoryview(bytearray(100)))


def test_put_refuses_what_does_not_fit_and_writes_nothing(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, 2 * (BLOCK + 1000))
    assert tier.put(make_key(1), make_chunk(1, CHUNK))
    assert tier.put(make_key(2), make_chunk(2, CHUNK))

    assert not tier.put(make_key(3), make_chunk(3, CHUNK))
    assert not tier.put(make_key(1), make_chunk(1, 1001))  # replacing, but bigger

    assert tier.used_bytes == tier.capacity_bytes
    assert files_on_disk(tmp_path) == sorted(chunk_path(tmp_path, make_key(i)) for i in (1, 2))
    assert read(tier, make_key(1)) == make_chunk(1, CHUNK)
    assert tier.put(make_key(1), make_chunk(9, CHUNK))  # same size replaces in place
    assert read(tier, make_key(1)) == make_chunk(9, CHUNK)


def test_capacity_never_exceeded_under_concurrent_puts(tmp_path: Path) -> None:
    chunk = 20_000
    tier = SsdTier(tmp_path, 10 * (BLOCK + chunk))
    stored: list[int] = []
    seen_used: list[int] = []

    def writer(t: int) -> None:
        for i in range(t * 20, t * 20 + 20):
            if tier.put(make_key(i), make_chunk(i, chunk)):
                stored.append(i)
            seen_used.append(tier.used_bytes)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(writer, range(8)))

    assert len(stored) == 10
    assert max(seen_used) <= tier.capacity_bytes
    assert tier.used_bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path))
    assert all(read(tier, make_key(i)) == make_chunk(i, chunk) for i in stored)


def test_concurrent_puts_deletes_and_reads_keep_accounting_exact(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, 6 * (BLOCK + 3000))

    def worker(t: int) -> None:
        for n in range(60):
            i = (t + n) % 12
            tier.put(make_key(i), make_chunk(i, 1000 + 1000 * (i % 3)))
            got = read(tier, make_key((i + 5) % 12))
            assert got is None or got == make_chunk((i + 5) % 12, len(got))
            assert tier.used_bytes <= tier.capacity_bytes
            if n % 3 == 0:
                tier.delete(make_key((i + 7) % 12))

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(worker, range(6)))  # re-raises a worker's failure

    on_disk = files_on_disk(tmp_path)
    assert tier.used_bytes == sum(p.stat().st_size for p in on_disk)
    assert tier.num_chunks == len(on_disk)


def test_restart_sees_chunks_in_mtime_order(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, MiB)
    keys = [make_key(i) for i in range(3)]
    for i, key in enumerate(keys):
        tier.put(key, make_chunk(i, 100 + i))
    for order, i in enumerate([2, 0, 1]):
        stamp = 1_700_000_000_000_000_000 + order * 1_000_000_000
        os.utime(chunk_path(tmp_path, keys[i]), ns=(stamp, stamp))

    again = SsdTier(tmp_path, MiB)

    assert list(again.scan()) == [(keys[2], 102), (keys[0], 100), (keys[1], 101)]
    assert again.used_bytes == tier.used_bytes
    assert all(read(again, keys[i]) == make_chunk(i, 100 + i) for i in range(3))


def test_read_makes_chunk_most_recent(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, MiB)
    for i in range(3):
        tier.put(make_key(i), make_chunk(i, CHUNK))

    read(tier, make_key(0))

    assert [key for key, _ in tier.scan()] == [make_key(1), make_key(2), make_key(0)]


def test_restart_trims_to_a_smaller_capacity_oldest_first(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, MiB)
    for i in range(3):
        tier.put(make_key(i), make_chunk(i, CHUNK))
        stamp = 1_700_000_000_000_000_000 + i * 1_000_000_000
        os.utime(chunk_path(tmp_path, make_key(i)), ns=(stamp, stamp))

    again = SsdTier(tmp_path, 2 * (BLOCK + 1000))

    assert [key for key, _ in again.scan()] == [make_key(1), make_key(2)]
    assert not chunk_path(tmp_path, make_key(0)).exists()


def test_corrupted_payload_byte_raises_and_drops_the_file(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, MiB)
    key = make_key(1)
    tier.put(key, make_chunk(1, CHUNK))
    path = chunk_path(tmp_path, key)
    with open(path, "r+b") as f:
        f.seek(BLOCK + 5)
        byte = f.read(1)
        f.seek(BLOCK + 5)
        f.write(bytes([byte[0] ^ 0xFF]))

    with pytest.raises(Corrupted, match=re.escape(str(path))):
        tier.read_into(key, memoryview(bytearray(1000)))

    assert not path.exists()
    assert tier.size_of(key) is None
    assert tier.used_bytes == 0


def test_bad_files_are_dropped_at_restart(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = SsdTier(tmp_path, MiB)
    for i in range(5):
        tier.put(make_key(i), make_chunk(i, CHUNK))
    paths = [chunk_path(tmp_path, make_key(i)) for i in range(5)]
    os.truncate(paths[1], BLOCK + 10)  # truncated payload
    os.truncate(paths[2], 20)  # truncated header
    with open(paths[3], "r+b") as f:
        f.write(b"NOTMAGIC")
    os.replace(paths[4], chunk_path(tmp_path, make_key(5)))  # renamed: header names key 4

    with caplog.at_level(logging.WARNING, logger="lmcache_svc.tiers.ssd"):
        again = SsdTier(tmp_path, MiB)

    assert list(again.scan()) == [(make_key(0), 1000)]
    assert files_on_disk(tmp_path) == [paths[0]]
    assert again.used_bytes == BLOCK + 1000
    assert sum("removing bad chunk file" in r.message for r in caplog.records) == 4


def test_tmp_leftovers_are_removed_at_start(tmp_path: Path) -> None:
    SsdTier(tmp_path, MiB)
    (tmp_path / "tmp" / "dead.tmp").write_bytes(b"half a chunk")

    SsdTier(tmp_path, MiB)

    assert os.listdir(tmp_path / "tmp") == []


def test_size_mismatch_is_invalid_argument(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, MiB)
    tier.put(make_key(1), make_chunk(1, CHUNK))

    with pytest.raises(InvalidArgument, match="999 bytes"):
        tier.read_into(make_key(1), memoryview(bytearray(999)))
    with pytest.raises(InvalidArgument, match="writable"):
        tier.read_into(make_key(1), memoryview(bytes(1000)))
    with pytest.raises(InvalidArgument, match="48 bytes"):
        tier.put(ChunkKey(b"short"), b"x")
    with pytest.raises(InvalidArgument, match="contiguous"):
        tier.put(make_key(2), np.zeros(100, dtype=np.uint8)[::2].data)


def test_typed_buffers_are_stored_as_their_bytes(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, MiB)
    values = np.arange(600, dtype=np.float16).reshape(20, 30)

    assert tier.put(make_key(1), values.data)

    assert tier.size_of(make_key(1)) == values.nbytes
    out = np.empty_like(values)
    assert tier.read_into(make_key(1), out.data)
    assert np.array_equal(out, values)


def test_vanished_file_reads_as_a_miss(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, MiB)
    tier.put(make_key(1), make_chunk(1, CHUNK))
    chunk_path(tmp_path, make_key(1)).unlink()

    assert not tier.read_into(make_key(1), memoryview(bytearray(1000)))

    assert tier.size_of(make_key(1)) is None
    assert tier.used_bytes == 0


def test_os_error_on_read_is_a_tier_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = SsdTier(tmp_path, MiB)
    tier.put(make_key(1), make_chunk(1, CHUNK))

    def failing_open(path: str, flags: int, mode: int = 0o777) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO), path)

    monkeypatch.setattr(ssd.os, "open", failing_open)
    with pytest.raises(
        TierError, match=re.escape(f"{chunk_path(tmp_path, make_key(1))}: Input/output error")
    ):
        tier.read_into(make_key(1), memoryview(bytearray(1000)))


def test_failed_write_releases_its_reservation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = SsdTier(tmp_path, MiB)

    def failing_pwritev(fd: int, bufs: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ssd.os, "pwritev", failing_pwritev)
    with pytest.raises(TierError, match="No space left"):
        tier.put(make_key(1), make_chunk(1, CHUNK))

    assert tier.used_bytes == 0
    assert tier.num_chunks == 0
    assert os.listdir(tmp_path / "tmp") == []


def test_batches_keep_input_order_and_per_chunk_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier = SsdTier(tmp_path, 4 * (BLOCK + 1000))
    assert tier.put_many([(make_key(i), make_chunk(i, CHUNK)) for i in range(5)]) == [True] * 4 + [
        False
    ]
    corrupt_path = chunk_path(tmp_path, make_key(1))
    os.truncate(corrupt_path, BLOCK + 10)
    real_open, failing_path = os.open, str(chunk_path(tmp_path, make_key(2)))

    def open_failing_one(path: str, flags: int, mode: int = 0o777) -> int:
        if path == failing_path:
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(ssd.os, "open", open_failing_one)
    order = [3, 1, 4, 2, 0]
    outs = [bytearray(1000) for _ in order]
    with caplog.at_level(logging.WARNING, logger="lmcache_svc.tiers.ssd"):
        got = tier.read_many_into([(make_key(i), memoryview(o)) for i, o in zip(order, outs)])

    assert [r is True for r in got] == [True, False, False, False, True]
    assert got[2] is False  # absent (beyond capacity, never stored)
    assert isinstance(got[1], Failed) and isinstance(got[1].error, Corrupted)  # dropped
    assert isinstance(got[3], Failed) and not isinstance(got[3].error, Corrupted)  # kept
    assert (bytes(outs[0]), bytes(outs[4])) == (make_chunk(3, CHUNK), make_chunk(0, CHUNK))
    assert not corrupt_path.exists() and tier.size_of(make_key(1)) is None
    assert tier.size_of(make_key(2)) == 1000  # an I/O error drops nothing
    assert sum("read of" in r.message for r in caplog.records) == 2
    assert [key for key, _ in tier.scan()] == [make_key(i) for i in (3, 2, 0)]  # read order


def test_put_many_failed_write_releases_only_its_reservation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = SsdTier(tmp_path, MiB)
    real_pwritev, calls = os.pwritev, iter(range(100))

    def pwritev_failing_second(fd: int, bufs: list[memoryview], offset: int) -> int:
        if next(calls) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwritev(fd, bufs, offset)

    monkeypatch.setattr(ssd.os, "pwritev", pwritev_failing_second)
    got = tier.put_many([(make_key(i), make_chunk(i, CHUNK)) for i in range(3)])

    assert [r is True for r in got].count(True) == 2
    (failed,) = [r for r in got if r is not True]
    assert isinstance(failed, Failed) and "No space left" in str(failed.error)
    assert tier.used_bytes == 2 * (BLOCK + 1000) == tier.num_chunks * (BLOCK + 1000)
    assert os.listdir(tmp_path / "tmp") == []


def test_put_many_reports_an_overwrite_whose_old_file_cannot_be_removed(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, MiB)
    assert tier.put(make_key(1), make_chunk(1, CHUNK))
    old = chunk_path(tmp_path, make_key(1))
    old.unlink()
    (old / "stuck").mkdir(parents=True)  # a directory where the old file was: unlink fails
    got = tier.put_many([(make_key(1), make_chunk(2, CHUNK)), (make_key(2), make_chunk(2, CHUNK))])

    assert isinstance(got[0], Failed) and "removing" in str(got[0].error) and got[1] is True
    assert read(tier, make_key(2)) == make_chunk(2, CHUNK)
    assert tier.used_bytes == 2 * (BLOCK + 1000)  # the old chunk is still indexed and counted


def test_put_many_with_a_repeated_key_keeps_the_last(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, MiB)
    items = [
        (make_key(1), make_chunk(1, CHUNK)),
        (make_key(2), make_chunk(2, CHUNK)),
        (make_key(1), b"new"),
    ]

    assert tier.put_many(items) == [True, True, True]

    assert read(tier, make_key(1)) == b"new"
    assert tier.used_bytes == 2 * BLOCK + 1000 + 3


def test_batches_still_work_after_close(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, MiB)
    assert tier.put_many([(make_key(i), make_chunk(i, CHUNK)) for i in range(3)]) == [True] * 3

    tier.close()
    tier.close()

    outs = [bytearray(1000) for _ in range(3)]
    assert tier.read_many_into([(make_key(i), memoryview(outs[i])) for i in range(3)]) == [True] * 3
    assert [bytes(o) for o in outs] == [make_chunk(i, CHUNK) for i in range(3)]


def test_fsync_always_round_trip(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, MiB, fsync="always")
    assert tier.put(make_key(1), make_chunk(1, CHUNK))
    assert read(SsdTier(tmp_path, MiB, fsync="always"), make_key(1)) == make_chunk(1, CHUNK)


@pytest.mark.parametrize("make_path", ["regular file", "under a regular file"])
def test_path_that_is_not_a_writable_directory_is_a_config_error(
    tmp_path: Path, make_path: str
) -> None:
    (tmp_path / "file").write_bytes(b"")
    path = tmp_path / "file" if make_path == "regular file" else tmp_path / "file" / "sub"

    with pytest.raises(ConfigError, match=re.escape(str(path))):
        SsdTier(path, MiB)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_read_only_directory_is_a_config_error(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match=re.escape(str(tmp_path))):
            SsdTier(tmp_path / "ssd", MiB)
    finally:
        tmp_path.chmod(0o700)


def test_o_direct_rejected_by_the_filesystem_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def open_without_direct(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(ssd.os, "open", open_without_direct)
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path)) + ".*o_direct off"):
        SsdTier(tmp_path, MiB, o_direct=True)


# -- O_DIRECT on a real disk -------------------------------------------------------------------


@pytest.fixture
def disk_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a filesystem that accepts O_DIRECT (tmp_path, else /var/tmp)."""
    for parent in (tmp_path, Path("/var/tmp")):
        try:
            path = Path(tempfile.mkdtemp(prefix="ssd-odirect-", dir=parent))
            SsdTier(path, MiB, o_direct=True)
        except (OSError, ConfigError):
            continue
        yield path
        _remove_tree(path)
        return
    pytest.skip("no directory here accepts O_DIRECT")


def _remove_tree(path: Path) -> None:
    for child in sorted(path.rglob("*"), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    path.rmdir()


def aligned_buffer(nbytes: int, shift: int = 0) -> memoryview:
    """A page-aligned buffer (or one ``shift`` bytes past a page boundary)."""
    return memoryview(mmap.mmap(-1, nbytes + shift + 1))[shift : shift + nbytes]


@pytest.mark.parametrize("nbytes", [0, 1, BLOCK, 3 * BLOCK + 17, 5 * MiB + 3])
@pytest.mark.parametrize("shift", [0, 1], ids=["aligned", "unaligned"])
def test_o_direct_round_trip(disk_dir: Path, nbytes: int, shift: int) -> None:
    tier = SsdTier(disk_dir, 64 * MiB, o_direct=True)
    key, data = make_key(nbytes), make_chunk(nbytes, nbytes)
    source = aligned_buffer(nbytes, shift)
    source[:] = data

    assert tier.put(key, source)

    size = chunk_path(disk_dir, key).stat().st_size
    assert size % BLOCK == 0
    assert tier.used_bytes == size == -(-(BLOCK + nbytes) // BLOCK) * BLOCK
    out = aligned_buffer(nbytes, shift)
    assert tier.read_into(key, out)
    assert bytes(out) == data
    assert read(SsdTier(disk_dir, 64 * MiB), key) == data  # padded files read without O_DIRECT


def test_o_direct_reads_unpadded_files_and_detects_corruption(disk_dir: Path) -> None:
    SsdTier(disk_dir, MiB).put(make_key(1), make_chunk(1, 5000))
    tier = SsdTier(disk_dir, MiB, o_direct=True)
    assert read(tier, make_key(1)) == make_chunk(1, 5000)

    path = chunk_path(disk_dir, make_key(1))
    with open(path, "r+b") as f:
        f.seek(BLOCK + 4999)
        f.write(b"\x00" if make_chunk(1, 5000)[-1] else b"\x01")
    with pytest.raises(Corrupted, match=re.escape(str(path))):
        tier.read_into(make_key(1), aligned_buffer(5000))
    assert not path.exists()

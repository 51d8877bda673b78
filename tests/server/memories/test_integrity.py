"""What a memory store never does: serve bytes other than those stored, refuse to start over
a bad file, hold a whole blob per read, or make a list wait behind a write's fsync."""

from __future__ import annotations

import logging
import os
import struct
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash

from lmcache_svc.errors import MemoryCorrupted, TooBusy
from lmcache_svc.server.memories import blobs
from lmcache_svc.server.memories.store import MemoryStore
from tests.server.memories.blobs import make_memory, memory_id_of, tensor

MIB = 1 << 20


def dir_store(path: Path, **kwargs: int) -> MemoryStore:
    kwargs.setdefault("capacity_bytes", 256 * MIB)
    kwargs.setdefault("max_bytes", 128 * MIB)
    return MemoryStore(path=path, **kwargs)


def file_of(path: Path, memory_id: str) -> Path:
    (found,) = path.glob(f"t-*/{memory_id}*.safetensors")
    return found


def flip(file: Path, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("where", ["data", "header"])
def test_a_bit_flipped_file_is_refused_counted_and_quarantined(tmp_path: Path, where: str) -> None:
    path = tmp_path / "memories"
    store = dir_store(path)
    blob = make_memory(seed=1, metadata={"doc": "faq"})
    mid = memory_id_of(blob)
    store.put("acme", blob)
    file = file_of(path, mid)
    (n,) = struct.unpack("<Q", blob[:8])
    flip(file, len(blob) - 3 if where == "data" else 8 + n - 10)

    with pytest.raises(MemoryCorrupted, match=f"memory {mid} .*checksum.*quarantine"):
        store.get("acme", mid)
    assert not file.exists()
    (moved,) = (path / "quarantine").glob("t-*/*")
    assert moved.is_file() and moved.name.startswith(mid)
    assert store.usage().num_corrupted == 1
    assert store.info("acme", mid) is None and store.get("acme", mid) is None
    assert store.usage().used_bytes == 0 and store.list("acme") == []
    assert store.put("acme", blob)[1] is True  # stored again, intact
    assert store.get("acme", mid) == blob
    assert dir_store(path).get("acme", mid) == blob  # the quarantine is not scanned


def test_bytes_changed_between_the_check_and_the_stream_fail_the_stream(tmp_path: Path) -> None:
    path = tmp_path / "memories"
    store = dir_store(path)
    blob = make_memory(seed=2, tensors={"t": tensor([64, 1024], dtype="U8")})
    mid = memory_id_of(blob)
    store.put("acme", blob)
    read = store.open("acme", mid)
    assert read is not None
    flip(file_of(path, mid), len(blob) - 1)  # after the verifying pass
    with pytest.raises(MemoryCorrupted):
        for _ in read.pieces(4096):
            pass
    read.close()
    assert store.info("acme", mid) is None and store.usage().num_corrupted == 1


def write_raw(tenant_dir: Path, name: str, data: bytes) -> Path:
    tenant_dir.mkdir(parents=True, exist_ok=True)
    file = tenant_dir / name
    file.write_bytes(data)
    return file


def raw(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def test_start_up_skips_and_reports_every_bad_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "memories"
    good = make_memory(seed=1)
    dir_store(path).put("acme", good)
    tenant_dir = next(path.glob("t-*"))
    ids = [f"0000000{i}-0000-4000-8000-000000000000" for i in range(6)]
    bad = {
        ids[0]: raw(b'{"t": [' + b"9" * 5000 + b"]}"),  # a 5,000-digit integer
        ids[1]: raw(b'{"t": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),  # deep nesting
        ids[2]: make_memory(ids[2], seed=3)[:-5],  # truncated
        ids[3]: os.urandom(4096),  # garbage
        ids[4]: struct.pack("<Q", 1 << 40) + b"{}",  # a header bigger than the file
        ids[5]: raw(b"\xff" * (2 * MIB), b""),  # a header over the limit
    }
    files = [write_raw(tenant_dir, f"{mid}.safetensors", data) for mid, data in bad.items()]

    with caplog.at_level(logging.WARNING):
        store = dir_store(path)
    assert [i.memory_id for i in store.list("acme")] == [memory_id_of(good)]
    assert store.usage().num_skipped_files == len(bad)
    for file in files:
        assert f"ignoring {file}:" in caplog.text and file.exists()  # reported, left alone
    assert "integer of 5000 digits" in caplog.text and "nested too deeply" in caplog.text


def test_files_of_an_earlier_version_get_their_checksum_on_first_start(tmp_path: Path) -> None:
    path = tmp_path / "memories"
    blob = make_memory(seed=4)
    mid = memory_id_of(blob)
    tenant_dir = path / ("t-" + b"acme".hex())
    write_raw(tenant_dir, f"{mid}.safetensors", blob)  # as the earlier version wrote it

    store = dir_store(path)
    assert store.get("acme", mid) == blob
    file = file_of(path, mid)
    assert file.name == f"{mid}.{xxhash.xxh3_64_hexdigest(blob)}.safetensors"
    flip(file, len(blob) - 1)
    with pytest.raises(MemoryCorrupted):
        dir_store(path).get("acme", mid)


def test_a_list_never_waits_behind_a_writes_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = dir_store(tmp_path / "memories")
    store.put("acme", make_memory(seed=1))
    in_fsync, release = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        in_fsync.set()
        assert release.wait(30)
        real_fsync(fd)

    monkeypatch.setattr(blobs.os, "fsync", slow_fsync)
    writer = threading.Thread(target=store.put, args=("acme", make_memory(seed=2)))
    writer.start()
    try:
        assert in_fsync.wait(30)
        listed: list[int] = []
        lister = threading.Thread(target=lambda: listed.append(len(store.list("acme"))))
        lister.start()
        lister.join(10)  # a deadlock detector: on the old code the list waits for release
        assert listed == [1], "the list waited behind the write's fsync"
        assert store.usage().num_memories == 1  # the memory being written is not listed yet
    finally:
        release.set()
        writer.join(30)
    assert store.usage().num_memories == 2


def test_puts_and_deletes_of_one_id_take_turns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second put (the same bytes) or a delete of an id being written waits for that write
    instead of failing, as if the write's I/O were under the store's lock."""
    store = dir_store(tmp_path / "memories")
    real_fsync = os.fsync
    gate: dict[str, threading.Event] = {}

    def slow_fsync(fd: int) -> None:
        if "release" in gate and not gate["release"].is_set():
            gate["entered"].set()
            assert gate["release"].wait(30)
        real_fsync(fd)

    monkeypatch.setattr(blobs.os, "fsync", slow_fsync)

    def while_writing(blob: bytes, second: Callable[[], object]) -> list[object]:
        gate.update(entered=threading.Event(), release=threading.Event())
        results: list[object] = []
        writer = threading.Thread(target=lambda: results.append(store.put("acme", blob)[1]))
        writer.start()
        assert gate["entered"].wait(30)
        other = threading.Thread(target=lambda: results.append(second()))
        other.start()
        gate["release"].set()
        writer.join(30)
        other.join(30)
        return results

    again = make_memory(seed=3)
    assert sorted(while_writing(again, lambda: store.put("acme", again)[1])) == [False, True]
    gone = make_memory(seed=4)
    assert while_writing(gone, lambda: store.delete("acme", memory_id_of(gone))) == [True, True]
    assert store.get("acme", memory_id_of(gone)) is None
    assert store.get("acme", memory_id_of(again)) == again
    assert store.usage().used_bytes == len(again)


@pytest.mark.parametrize("on_disk", [True, False])
def test_a_read_holds_one_piece_not_the_blob(tmp_path: Path, on_disk: bool) -> None:
    blob = make_memory(tensors={"t": ("U8", [32, MIB], os.urandom(32 * MIB))})
    store = (
        dir_store(tmp_path / "memories")
        if on_disk
        else MemoryStore(capacity_bytes=256 * MIB, max_bytes=128 * MIB)
    )
    mid = memory_id_of(blob)
    store.put("acme", blob)
    expected = xxhash.xxh3_64_hexdigest(blob)
    del blob
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        read = store.open("acme", mid)
        assert read is not None
        digest = xxhash.xxh3_64()
        with read:
            for piece in read.pieces(MIB):
                digest.update(piece)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert digest.hexdigest() == expected
    assert peak - base < 4 * MIB, f"a 32 MiB read held {(peak - base) / MIB:.1f} MiB"


def test_reads_beyond_the_cap_are_too_busy_until_one_ends(tmp_path: Path) -> None:
    store = dir_store(tmp_path / "memories", max_transfers=2)
    blob = make_memory(seed=6)
    mid = memory_id_of(blob)
    store.put("acme", blob)
    first, second = store.open("acme", mid), store.open("acme", mid)
    assert first is not None and second is not None
    with pytest.raises(TooBusy, match="memory.max_transfers"):
        store.open("acme", mid)
    first.close()
    first.close()  # closing twice gives back one slot
    third = store.open("acme", mid)
    assert third is not None and b"".join(third.pieces(64)) == blob
    with pytest.raises(TooBusy):
        store.open("acme", mid)
    second.close()
    third.close()


def test_a_memory_deleted_while_being_read_is_still_read_whole(tmp_path: Path) -> None:
    store = dir_store(tmp_path / "memories")
    blob = make_memory(seed=7, tensors={"t": tensor([256, 1024], dtype="U8")})
    mid = memory_id_of(blob)
    store.put("acme", blob)
    read = store.open("acme", mid)
    assert read is not None
    pieces = read.pieces(4096)
    first = next(pieces)
    assert store.delete("acme", mid) is True
    assert first + b"".join(pieces) == blob
    read.close()
    assert store.get("acme", mid) is None

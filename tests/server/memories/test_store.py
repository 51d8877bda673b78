"""MemoryStore: tenant scoping, idempotent puts, conflicts, capacity, persistence."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lmcache_svc.config import load_config
from lmcache_svc.errors import BadMemory, Conflict, InvalidArgument, NoSpace, PayloadTooLarge
from lmcache_svc.server.memories.store import MemoryStore
from tests.server.memories.blobs import make_memory, memory_id_of, tensor

MakeStore = Callable[..., MemoryStore]


@pytest.fixture(params=["ram", "dir"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> MakeStore:
    def make(capacity_bytes: int = 1 << 20, max_bytes: int = 1 << 20) -> MemoryStore:
        path = tmp_path / "memories" if request.param == "dir" else None
        return MemoryStore(capacity_bytes=capacity_bytes, max_bytes=max_bytes, path=path)

    return make


def test_put_get_list_delete(make_store: MakeStore) -> None:
    store = make_store()
    a, b = make_memory(seed=1), make_memory(seed=2, metadata={"n": 2})
    info_a, created = store.put("default", a)
    assert created and info_a.memory_id == memory_id_of(a) and info_a.size_bytes == len(a)
    store.put("default", b)
    assert store.get("default", info_a.memory_id) == a
    assert [i.memory_id for i in store.list("default")] == sorted(
        [memory_id_of(a), memory_id_of(b)]
    )
    assert store.usage().num_memories == 2 and store.usage().used_bytes == len(a) + len(b)
    assert store.delete("default", info_a.memory_id) is True
    assert store.delete("default", info_a.memory_id) is False
    assert store.get("default", info_a.memory_id) is None
    assert store.info("default", info_a.memory_id) is None
    assert [i.memory_id for i in store.list("default")] == [memory_id_of(b)]
    assert store.usage().used_bytes == len(b)


def test_same_bytes_again_is_a_no_op_and_other_bytes_a_conflict(make_store: MakeStore) -> None:
    store = make_store()
    blob = make_memory(seed=1)
    first, _ = store.put("default", blob)
    again, created = store.put("default", bytearray(blob))
    assert (again, created) == (first, False)
    assert store.usage().used_bytes == len(blob)
    other = make_memory(memory_id_of(blob), seed=9)  # same id and size, other bytes
    assert len(other) == len(blob)
    with pytest.raises(Conflict, match="already stored with other bytes"):
        store.put("default", other)
    with pytest.raises(Conflict):
        store.put("default", make_memory(memory_id_of(blob), metadata={"longer": "metadata"}))
    assert store.get("default", first.memory_id) == blob


def test_tenants_see_only_their_own_memories(make_store: MakeStore) -> None:
    store = make_store()
    blob = make_memory(seed=1)
    mid = memory_id_of(blob)
    store.put("alice", blob)
    assert store.get("bob", mid) is None and store.list("bob") == []
    assert store.delete("bob", mid) is False
    # the same id under another tenant is another memory, other bytes allowed
    other = make_memory(mid, seed=5)
    assert store.put("bob", other)[1] is True
    assert store.get("alice", mid) == blob and store.get("bob", mid) == other
    assert store.usage().num_memories == 2


def test_capacity_is_never_exceeded(make_store: MakeStore) -> None:
    blob = make_memory(seed=1)
    store = make_store(capacity_bytes=2 * len(blob))
    store.put("default", blob)
    store.put("default", make_memory(seed=2))  # same size: exactly full
    assert store.usage().used_bytes == 2 * len(blob)
    third = make_memory(seed=3)
    with pytest.raises(NoSpace, match=f"{2 * len(blob)} of {2 * len(blob)} bytes"):
        store.put("default", third)
    store.put("default", blob)  # a re-put of stored bytes needs no room
    store.delete("default", memory_id_of(blob))
    assert store.put("default", third)[1] is True


def test_oversize_and_malformed_bodies_are_refused(make_store: MakeStore) -> None:
    blob = make_memory(seed=1)
    store = make_store(max_bytes=len(blob) - 1)
    with pytest.raises(PayloadTooLarge, match="memory.max_bytes"):
        store.put("default", blob)
    with pytest.raises(BadMemory):
        store.put("default", b"\x00" * 100)
    assert store.usage().num_memories == 0


@pytest.mark.parametrize("bad_id", ["../escape", "x", "0F8FAD5B-D9CB-469F-A165-70867728950E"])
def test_bad_ids_and_tenants_are_invalid_arguments(make_store: MakeStore, bad_id: str) -> None:
    store = make_store()
    for call in (store.get, store.info, store.delete):
        with pytest.raises(InvalidArgument, match="canonical lowercase UUID"):
            call("default", bad_id)
    with pytest.raises(InvalidArgument, match="tenant"):
        store.list("")


def test_memories_persist_across_a_new_store_on_the_same_path(tmp_path: Path) -> None:
    path = tmp_path / "memories"
    store = MemoryStore(capacity_bytes=1 << 20, max_bytes=1 << 20, path=path)
    kept, dropped = make_memory(seed=1, metadata={"x": 1}), make_memory(seed=2)
    store.put("default", kept)
    store.put("tenant/with spaces", dropped)
    store.put("default", dropped)
    store.delete("default", memory_id_of(dropped))

    again = MemoryStore(capacity_bytes=1 << 20, max_bytes=1 << 20, path=path)
    assert again.list("default") == store.list("default")
    assert again.get("default", memory_id_of(kept)) == kept
    assert again.get("tenant/with spaces", memory_id_of(dropped)) == dropped
    assert again.usage() == store.usage()
    with pytest.raises(Conflict):  # the reloaded memory still guards its id
        again.put("default", make_memory(memory_id_of(kept), seed=7))


def test_start_up_scan_skips_what_is_not_a_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "memories"
    store = MemoryStore(capacity_bytes=1 << 20, max_bytes=1 << 20, path=path)
    good = make_memory(seed=1)
    store.put("default", good)
    tenant_dir = next(path.glob("t-*"))
    (tenant_dir / "0f8fad5b-d9cb-469f-a165-70867728950e.safetensors").write_bytes(b"garbage!!")
    misnamed = make_memory(seed=2)
    (tenant_dir / "11111111-2222-3333-4444-555555555555.safetensors").write_bytes(misnamed)
    (path / "tmp" / "half-written.tmp").write_bytes(b"partial")
    (path / "t-zz").mkdir()

    with caplog.at_level(logging.WARNING):
        again = MemoryStore(capacity_bytes=1 << 20, max_bytes=1 << 20, path=path)
    assert [i.memory_id for i in again.list("default")] == [memory_id_of(good)]
    assert again.usage().used_bytes == len(good)
    assert not list((path / "tmp").iterdir())
    log = caplog.text
    garbage = tenant_dir / "0f8fad5b-d9cb-469f-a165-70867728950e.safetensors"
    assert f"ignoring {garbage}: not safetensors" in log
    assert f"it holds memory {memory_id_of(misnamed)}" in log
    assert "removed 1 unfinished writes" in log
    assert "not a tenant directory" in log


def test_memory_path_defaults_under_the_ssd_tier(tmp_path: Path) -> None:
    cfg = load_config(env={}, overrides={"ssd.path": str(tmp_path / "ssd")})
    assert cfg.memory.resolved_path(cfg.ssd.path) == tmp_path / "ssd" / "memories"
    cfg = load_config(env={}, overrides={"ssd.path": str(tmp_path), "memory.path": "/m"})
    assert cfg.memory.resolved_path(cfg.ssd.path) == Path("/m")
    cfg = load_config(env={})
    assert cfg.memory.resolved_path(cfg.ssd.path) is None
    assert int(cfg.memory.capacity) == 1 << 30


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (needs root and mount; skipped elsewhere)."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_a_full_disk_is_no_space_and_leaves_nothing_behind(tiny_fs: Path) -> None:
    store = MemoryStore(capacity_bytes=1 << 20, max_bytes=1 << 20, path=tiny_fs)
    big = make_memory(tensors={"t": tensor([64, 1024], dtype="U8")})  # 64 KiB of data
    with pytest.raises(NoSpace, match="is full"):
        store.put("default", big)
    assert store.usage().num_memories == 0 and store.usage().used_bytes == 0
    assert not list((tiny_fs / "tmp").iterdir())
    small = make_memory(seed=1)
    assert store.put("default", small)[1] is True  # the space was given back

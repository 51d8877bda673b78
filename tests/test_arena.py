"""The shared-memory slab arena: exact offsets, slab reuse, limits, and a second process."""

from __future__ import annotations

import itertools
import os
import random
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lmcache_svc.arena import HEADER_BYTES, MAGIC, SHM_DIR, Arena, ArenaMapping
from lmcache_svc.errors import ConfigError, InvalidArgument
from lmcache_svc.tiers.base import Slot

KIB = 1024
SLAB = 64 * KIB
PAGE = 4 * KIB

MakeArena = Callable[..., Arena]


@pytest.fixture
def make_arena() -> Iterator[MakeArena]:
    arenas: list[Arena] = []

    def make(num_slabs: int = 4, **kwargs: object) -> Arena:
        kwargs.setdefault("slab_bytes", SLAB)
        kwargs.setdefault("prefault", "off")
        size = kwargs.pop("size_bytes", num_slabs * SLAB)
        arena = Arena.create(size, **kwargs)  # type: ignore[arg-type]
        arenas.append(arena)
        return arena

    yield make
    for arena in arenas:
        arena.close()


def slab_at(index: int) -> int:
    return HEADER_BYTES + index * SLAB


def test_exact_offsets_for_a_known_sequence(make_arena: MakeArena) -> None:
    arena = make_arena()
    slots = [arena.allocate(n) for n in (4096, 1, 5000, 8192, 4096)]
    assert slots == [
        Slot(slab_at(0), 4096),
        Slot(slab_at(0) + PAGE, 1),
        Slot(slab_at(1), 5000),
        Slot(slab_at(1) + 2 * PAGE, 8192),
        Slot(slab_at(0) + 2 * PAGE, 4096),
    ]
    assert arena.used_bytes == 3 * PAGE + 2 * 2 * PAGE
    assert arena.num_slots == 5
    assert arena.capacity_bytes == 4 * SLAB


def test_freed_slot_is_reused_first(make_arena: MakeArena) -> None:
    arena = make_arena()
    a, b, c = (arena.allocate(PAGE) for _ in range(3))
    assert a and b and c
    arena.free(b)
    assert arena.allocate(100) == Slot(b.offset, 100)
    assert arena.used_bytes == 3 * PAGE


def test_empty_slab_returns_to_pool_for_another_class(make_arena: MakeArena) -> None:
    arena = make_arena()
    small = [arena.allocate(PAGE) for _ in range(SLAB // PAGE)]  # fills slab 0
    assert arena.allocate(PAGE) == Slot(slab_at(1), PAGE)
    for slot in small:
        assert slot is not None
        arena.free(slot)
    assert arena.allocate(4 * PAGE) == Slot(slab_at(0), 4 * PAGE)
    assert arena.allocate(SLAB) == Slot(slab_at(2), SLAB)


def test_class_larger_than_a_slab_takes_a_run_of_contiguous_slabs(make_arena: MakeArena) -> None:
    arena = make_arena()
    page = arena.allocate(PAGE)
    assert page == Slot(slab_at(0), PAGE)
    run = arena.allocate(SLAB + 1)
    assert run == Slot(slab_at(1), SLAB + 1)
    assert arena.used_bytes == PAGE + SLAB + PAGE
    assert arena.allocate(SLAB + 1) is None  # only slab 3 is left
    assert arena.allocate(SLAB) == Slot(slab_at(3), SLAB)
    arena.free(page)
    assert arena.allocate(SLAB + 1) is None  # slabs 0 and 3 are free, but not contiguous
    arena.free(run)
    assert arena.allocate(3 * SLAB) == Slot(slab_at(0), 3 * SLAB)
    assert arena.used_bytes == arena.capacity_bytes


def test_allocate_returns_none_when_full(make_arena: MakeArena) -> None:
    arena = make_arena()
    slots = [arena.allocate(SLAB) for _ in range(4)]
    assert [s.offset for s in slots if s] == [slab_at(i) for i in range(4)]
    assert arena.used_bytes == arena.capacity_bytes
    assert arena.allocate(SLAB) is None
    assert arena.allocate(1) is None


def test_short_last_slab(make_arena: MakeArena) -> None:
    arena = make_arena(size_bytes=SLAB + 2 * PAGE)
    assert arena.capacity_bytes == SLAB + 2 * PAGE
    assert arena.allocate(SLAB) == Slot(slab_at(0), SLAB)
    assert arena.allocate(4 * PAGE) is None  # does not fit in the 2-page last slab
    assert arena.allocate(PAGE) == Slot(slab_at(1), PAGE)
    assert arena.allocate(PAGE) == Slot(slab_at(1) + PAGE, PAGE)
    assert arena.allocate(PAGE) is None


def test_size_is_rounded_up_to_pages(make_arena: MakeArena) -> None:
    arena = make_arena(size_bytes=SLAB + 1)
    assert arena.capacity_bytes == SLAB + PAGE
    assert arena.segment_size == HEADER_BYTES + SLAB + PAGE
    assert os.stat(os.path.join(SHM_DIR, arena.name)).st_size == arena.segment_size


def test_random_alloc_free_keeps_slots_disjoint_and_in_capacity(make_arena: MakeArena) -> None:
    arena = make_arena(num_slabs=16)
    rng = random.Random(1234)
    sizes = [1, PAGE, PAGE + 1, 3 * PAGE, 5 * PAGE, 16 * PAGE, SLAB + 7, 2 * SLAB]
    live: dict[int, tuple[Slot, int]] = {}
    for step in range(4000):
        if live and (rng.random() < 0.45 or len(live) > 200):
            slot, tag = live.pop(rng.choice(list(live)))
            view = arena.view(slot)
            assert (view[0], view[-1]) == (tag, tag), f"slot {slot} was overwritten"
            arena.free(slot)
        else:
            new = arena.allocate(rng.choice(sizes))
            if new is not None:
                view = arena.view(new)
                view[0] = view[-1] = step % 251
                live[new.offset] = (new, step % 251)
        check_disjoint(arena, [s for s, _ in live.values()])
    for left, _ in live.values():
        arena.free(left)
    assert arena.used_bytes == 0 and arena.num_slots == 0
    assert arena.allocate(arena.capacity_bytes) == Slot(HEADER_BYTES, arena.capacity_bytes)


def check_disjoint(arena: Arena, slots: list[Slot]) -> None:
    extents = sorted((s.offset, s.offset + arena.class_bytes_of(s)) for s in slots)
    assert sum(end - start for start, end in extents) == arena.used_bytes
    assert arena.used_bytes <= arena.capacity_bytes
    for (_, end), (start, _) in itertools.pairwise(extents):
        assert end <= start
    if extents:
        assert extents[0][0] >= HEADER_BYTES
        assert extents[-1][1] <= HEADER_BYTES + arena.capacity_bytes
        assert all(start % PAGE == 0 for start, _ in extents)


def test_double_free_and_unknown_slot_raise(make_arena: MakeArena) -> None:
    arena = make_arena()
    slot = arena.allocate(PAGE)
    assert slot is not None
    with pytest.raises(RuntimeError, match=f"offset {slot.offset}"):
        arena.free(Slot(slot.offset, PAGE + 1))
    arena.free(slot)
    with pytest.raises(RuntimeError, match=f"offset {slot.offset}"):
        arena.free(slot)
    with pytest.raises(RuntimeError, match="not an allocated slot"):
        arena.view(slot)


@pytest.mark.parametrize("nbytes", [0, -1, 4 * SLAB + 1, True, 1.5])
def test_bad_sizes_raise(make_arena: MakeArena, nbytes: object) -> None:
    arena = make_arena()
    with pytest.raises(InvalidArgument):
        arena.allocate(nbytes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("size", "slab"), [(0, SLAB), (-PAGE, SLAB), (SLAB, 0), (SLAB, 1000), (SLAB, PAGE + 1)]
)
def test_bad_arena_sizes_raise(size: int, slab: int) -> None:
    with pytest.raises(InvalidArgument):
        Arena.create(size, slab_bytes=slab, prefault="off")


@pytest.mark.parametrize("name", ["", "a/b", "..", ".hidden", "x" * 201, "sp ace", "é"])
def test_bad_names_raise(name: str) -> None:
    with pytest.raises(InvalidArgument):
        Arena.create(SLAB, name=name, prefault="off")


def test_existing_name_is_a_config_error(make_arena: MakeArena) -> None:
    arena = make_arena()
    with pytest.raises(ConfigError, match=arena.name):
        Arena.create(SLAB, name=arena.name, prefault="off")
    assert os.path.exists(os.path.join(SHM_DIR, arena.name))


def test_an_arena_larger_than_dev_shm_names_its_size_and_the_remedy() -> None:
    st = os.statvfs(SHM_DIR)
    too_big = (st.f_blocks * st.f_frsize) + (1 << 30)
    with pytest.raises(ConfigError) as raised:
        Arena.create(too_big, slab_bytes=SLAB, prefault="off")
    message = str(raised.value)
    assert f"its size: {(st.f_blocks * st.f_frsize) >> 20} MiB" in message
    assert f"needs {too_big >> 20} MiB" in message or f"needs {(too_big >> 20) + 1} MiB" in message
    assert "--shm-size" in message


def test_header_mode_and_prefault(make_arena: MakeArena) -> None:
    for prefault in ("sync", "background"):
        arena = make_arena(prefault=prefault, mode=0o640)
        assert arena.wait_prefaulted(10.0)
        path = os.path.join(SHM_DIR, arena.name)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
        with open(path, "rb") as f:
            assert f.read(len(MAGIC) + 16) == MAGIC + arena.nonce
    assert make_arena().prefault_done.is_set()  # "off": nothing to wait for


def test_close_unlinks_even_with_live_views(make_arena: MakeArena) -> None:
    arena = make_arena(prefault="background")
    slot = arena.allocate(PAGE)
    assert slot is not None
    view = arena.view(slot)
    path = os.path.join(SHM_DIR, arena.name)
    arena.close()
    assert not os.path.exists(path)
    assert arena.closed
    view[:3] = b"abc"  # still mapped until released
    assert bytes(view[:3]) == b"abc"
    view.release()
    arena.close()
    with pytest.raises(RuntimeError, match="closed"):
        arena.allocate(PAGE)


CHILD = """
import sys
from lmcache_svc.arena import ArenaMapping
name, size = sys.argv[1], int(sys.argv[2])
nonce, offset = bytes.fromhex(sys.argv[3]), int(sys.argv[4])
mapping = ArenaMapping.open(name, size, nonce, prefault=True)
assert mapping is not None and mapping.prefault_done.wait(10)
view = mapping.view(offset, 5)
assert bytes(view) == b"hello"
view[:] = b"world"
view.release()
mapping.close()
"""


def test_second_process_writes_through_its_mapping(make_arena: MakeArena) -> None:
    arena = make_arena()
    slot = arena.allocate(5)
    assert slot is not None
    arena.view(slot)[:] = b"hello"
    args = [arena.name, str(arena.segment_size), arena.nonce.hex(), str(slot.offset)]
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert bytes(arena.view(slot)) == b"world"


def test_mapping_refuses_another_segment(make_arena: MakeArena) -> None:
    arena = make_arena()
    size = arena.segment_size
    assert ArenaMapping.open(arena.name, size, bytes(16)) is None
    assert ArenaMapping.open(arena.name, size + PAGE, arena.nonce) is None
    assert ArenaMapping.open(arena.name + "-missing", size, arena.nonce) is None
    with ArenaMapping.open(arena.name, size, arena.nonce) as mapping:  # type: ignore[union-attr]
        assert mapping.size == size


def test_mapping_views_are_bounds_checked(make_arena: MakeArena) -> None:
    arena = make_arena()
    mapping = ArenaMapping.open(arena.name, arena.segment_size, arena.nonce)
    assert mapping is not None
    for offset, length in [(0, 1), (HEADER_BYTES - 1, 1), (arena.segment_size, 1), (PAGE, -1)]:
        with pytest.raises(InvalidArgument):
            mapping.view(offset, length)
    end = mapping.view(arena.segment_size - 1, 1)
    end[0] = 7
    slot = arena.allocate(arena.capacity_bytes)
    assert slot is not None and arena.view(slot)[-1] == 7
    mapping.close()
    mapping.close()


def test_segments_of_killed_servers_are_removed_live_ones_kept() -> None:
    import signal

    from lmcache_svc.arena import remove_orphan_segments

    prefix = f"lmcache-svc-orphan-{os.getpid()}-"
    code = (
        "import os, signal; from lmcache_svc.arena import Arena;"
        f"a = Arena.create(1 << 20, slab_bytes=1 << 16, name={prefix + 'dead'!r}, "
        "prefault='off'); os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    live = Arena.create(1 << 20, slab_bytes=1 << 16, name=prefix + "live", prefault="off")
    try:
        assert set(remove_orphan_segments(prefix)) <= {prefix + "dead"}  # (or another's did)
        assert not os.path.exists(f"/dev/shm/{prefix}dead")
        assert os.path.exists(f"/dev/shm/{prefix}live")
        # a fixed name left by a killed server is taken over; a live one is refused
        subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
        again = Arena.create(1 << 20, slab_bytes=1 << 16, name=prefix + "dead", prefault="off")
        again.close()
        with pytest.raises(ConfigError, match="already exists"):
            Arena.create(1 << 20, slab_bytes=1 << 16, name=prefix + "live", prefault="off")
    finally:
        live.close()


def _kill_after_creating(name: str) -> None:
    """Create a segment in a child process that is then SIGKILLed (no clean-up)."""
    import signal

    code = (
        "import os, signal; from lmcache_svc.arena import Arena;"
        f"a = Arena.create(1 << 20, slab_bytes=1 << 16, name={name!r}, prefault='off');"
        "a.view(a.allocate(4096))[:] = b'x' * 4096; os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def test_fresh_orphans_are_removed_at_once() -> None:
    """Two servers killed in quick succession: their segments are just created and were just
    written to (fresh ctime), yet no server holds them, so the next clean-up removes both."""
    from lmcache_svc.arena import remove_orphan_segments

    prefix = f"lmcache-svc-fresh-{os.getpid()}-"
    _kill_after_creating(prefix + "a")
    _kill_after_creating(prefix + "b")
    live = Arena.create(1 << 20, slab_bytes=1 << 16, name=prefix + "live", prefault="off")
    try:
        live.view(live.allocate(4096))[:] = b"y" * 4096
        # (a server starting elsewhere on this machine may remove them first: fine too)
        assert set(remove_orphan_segments(prefix)) <= {prefix + "a", prefix + "b"}
        assert sorted(os.listdir(SHM_DIR)).count(prefix + "live") == 1
        assert not any(n in os.listdir(SHM_DIR) for n in (prefix + "a", prefix + "b"))
    finally:
        live.close()
        for n in ("a", "b"):
            Path(SHM_DIR, prefix + n).unlink(missing_ok=True)


def test_a_segment_being_created_survives_a_concurrent_clean_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another server's start-up clean-up runs at the worst moment: after the new segment's
    file exists, before its creator locks it. The segment must not be removed."""
    import fcntl as real_fcntl

    from lmcache_svc import arena as arena_mod

    prefix = f"lmcache-svc-race-{os.getpid()}-"
    real_flock = real_fcntl.flock
    removed: list[list[str]] = []

    def flock_after_a_clean_up(fd: int, op: int) -> None:
        if not removed:  # the creator's own lock: a concurrent clean-up runs first
            removed.append([])
            removed[0] = arena_mod.remove_orphan_segments(prefix)
        real_flock(fd, op)

    monkeypatch.setattr(arena_mod.fcntl, "flock", flock_after_a_clean_up)
    arena = Arena.create(1 << 20, slab_bytes=1 << 16, name=prefix + "new", prefault="off")
    monkeypatch.setattr(arena_mod.fcntl, "flock", real_flock)
    try:
        assert removed == [[]]
        path = Path(SHM_DIR, prefix + "new")
        assert path.exists() and path.stat().st_size == arena.segment_size
        mapping = ArenaMapping.open(arena.name, arena.segment_size, arena.nonce)
        assert mapping is not None  # the name still leads to the server's own segment
        mapping.close()
        assert arena_mod.remove_orphan_segments(prefix) == []  # locked under its name
        assert not [
            n
            for n in os.listdir(SHM_DIR)
            if n.startswith(".lmcache-svc-creating-") and f"-{os.getpid()}-" in n
        ]
    finally:
        arena.close()


def test_load_views_are_read_only_and_store_views_writable() -> None:
    arena = Arena.create(1 << 20, slab_bytes=1 << 16, prefault="off")
    try:
        slot = arena.allocate(4096)
        assert slot is not None
        arena.view(slot)[:] = b"\x07" * 4096
        mapping = ArenaMapping.open(arena.name, arena.segment_size, arena.nonce, prefault=True)
        assert mapping is not None and mapping.prefault_done.wait(30)
        loaded = mapping.view(slot.offset, slot.length, writable=False)
        assert loaded.readonly and bytes(loaded) == b"\x07" * 4096
        with pytest.raises(TypeError):
            loaded[0] = 0  # a reader's stray write
        with pytest.raises(TypeError):
            loaded[:] = b"\x00" * 4096
        assert bytes(arena.view(slot)) == b"\x07" * 4096  # later readers see the committed bytes
        stored = mapping.view(slot.offset, slot.length)
        stored[:1] = b"\x01"  # a reserved slot is written through the read-write mapping
        assert bytes(loaded[:1]) == b"\x01"  # both mappings are the same pages
        del loaded, stored
        mapping.close()
    finally:
        arena.close()

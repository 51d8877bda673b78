"""The shared-memory lookup table: writer operations, overflow, readers racing the writer."""

from __future__ import annotations

import os
import platform
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from lmcache_svc.errors import InvalidArgument
from lmcache_svc.results import LookupResult, Placement
from lmcache_svc.server.index_publisher import IndexSegment
from lmcache_svc.shm.index_reader import IndexReader, answer_locally, open_index_segments
from lmcache_svc.shm.lookup_index import (
    BEAT_S,
    INDEX_TRANSPORT,
    MEDIUM_OFFSET,
    STALE_S,
    key_fingerprint,
    location_word,
    unsupported_cpu_reason,
)
from lmcache_svc.v1 import cache_pb2 as pb

NS = bytes.fromhex("5a17c0ffee0ddba11d0e5f00d4b1e5e7")
"""The namespace id of the chunks in these tables (entries are keyed by namespace + hash)."""


@contextmanager
def beating(seg: IndexSegment) -> Iterator[None]:
    """Stamp the table's heartbeat meanwhile, as the server's publisher does."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            seg.table.beat()
            stop.wait(BEAT_S)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@pytest.fixture
def seg() -> Iterator[IndexSegment]:
    s = IndexSegment("acme", "cpu", "host_memory", 64)
    with beating(s):
        yield s
    s.close()


def _reader(seg: IndexSegment) -> IndexReader:
    reader = IndexReader.open(seg.name, seg.size, seg.nonce)
    assert reader is not None
    return reader


def race(
    seg: IndexSegment, write: Callable[[], None], read: Callable[[], None], stop: threading.Event
) -> None:
    """One writer thread (until ``stop``) against two reader threads (to their end),
    switching threads as often as possible; the table is closed after."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        writer = threading.Thread(target=write)
        readers = [threading.Thread(target=read) for _ in range(2)]
        writer.start()
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        stop.set()
        writer.join()
    finally:
        sys.setswitchinterval(old)
        seg.close()


def _hashes(num: int, rng: random.Random) -> list[bytes]:
    return [rng.randbytes(32) for _ in range(num)]


def test_insert_lookup_remove_prefix(seg: IndexSegment) -> None:
    reader = _reader(seg)
    hs = _hashes(5, random.Random(1))
    for h in hs[:3]:
        assert seg.table.insert(NS + h)
    assert (reader.tenant, reader.tier_name, reader.medium) == ("acme", "cpu", "host_memory")
    answer = reader.lookup(NS, hs)
    assert answer is not None and (answer.num_hit_chunks, answer.final) == (3, True)
    assert seg.table.remove(NS + hs[1])
    assert not seg.table.remove(NS + hs[1])  # gone already
    answer = reader.lookup(NS, hs)
    assert answer is not None and answer.num_hit_chunks == 1  # a prefix: stops at the hole
    assert answer_locally({"acme": reader}, "acme", NS, hs[:1]) == LookupResult(
        1, ["cpu"], ["host_memory"]
    )
    assert answer_locally({"acme": reader}, "globex", NS, hs[:1]) is None  # no table mapped
    assert answer_locally({"acme": reader}, "acme", NS, [b"short"]) is None  # server's error


def test_the_header_names_the_first_tier_s_medium() -> None:
    """A local answer reports the medium the server published, e.g. an HBM first tier's."""
    seg = IndexSegment("acme", "hbm", "device", 64)
    try:
        with beating(seg):
            h, absent = _hashes(2, random.Random(3))
            seg.table.insert(NS + h)
            reader = _reader(seg)
            assert reader.medium == "device"
            got = answer_locally({"acme": reader}, "acme", NS, [h, absent])
            assert got == LookupResult(1, ["hbm"], ["device"])
            # A medium this reader does not know: the table is not used (the client asks).
            unknown = (5).to_bytes(8, "little") + b"tapes"
            seg._buf[MEDIUM_OFFSET : MEDIUM_OFFSET + len(unknown)] = unknown  # noqa: SLF001
            assert IndexReader.open(seg.name, seg.size, seg.nonce) is None
    finally:
        seg.close()


def test_random_operations_match_a_set(seg: IndexSegment) -> None:
    """Backward-shift removal keeps every other key findable (colliding homes included)."""
    rng = random.Random(7)
    pool = _hashes(40, rng)
    held: set[bytes] = set()
    for _ in range(3000):
        h = rng.choice(pool)
        if h in held:
            assert seg.table.remove(NS + h)
            held.discard(h)
        elif seg.table.insert(NS + h):
            held.add(h)
        assert seg.table.num_entries == len(held)
    assert all(seg.table.contains(NS + h) == (h in held) for h in pool)


def test_overflow_marks_misses_not_final_until_room(seg: IndexSegment) -> None:
    reader = _reader(seg)
    hs = _hashes(seg.table.max_entries + 2, random.Random(3))
    assert all(seg.table.insert(NS + h) for h in hs[:-2])
    assert not seg.table.insert(NS + hs[-2]) and not seg.table.insert(NS + hs[-1])
    assert not seg.table.complete
    answer = reader.lookup(NS, [hs[-1]])
    assert answer is not None and not answer.final  # may be a hit: ask the server
    full = reader.lookup(NS, hs[:4])
    assert full is not None and full.final and full.num_hit_chunks == 4  # a full hit is final
    seg.table.remove(NS + hs[0])  # room for one refused chunk
    seg.table.remove(NS + hs[1])  # and for the other: the table is complete again
    assert seg.table.complete
    assert seg.table.contains(NS + hs[-1]) and seg.table.contains(NS + hs[-2])
    assert reader.lookup(NS, [hs[0]]) == reader.lookup(NS, [hs[0]])
    assert not seg.table.contains(NS + hs[0])
    answer = reader.lookup(NS, [hs[0]])
    assert answer is not None and answer.final and answer.num_hit_chunks == 0


def test_lower_tiers_make_a_miss_not_final(seg: IndexSegment) -> None:
    reader = _reader(seg)
    h = random.Random(4).randbytes(32)
    seg.table.set_lower_tiers(True)
    answer = reader.lookup(NS, [h])
    assert answer is not None and not answer.final
    seg.table.insert(NS + h)
    answer = reader.lookup(NS, [h])
    assert answer is not None and answer.final and answer.num_hit_chunks == 1


def test_closed_table_answers_nothing(seg: IndexSegment) -> None:
    reader = _reader(seg)
    h = random.Random(5).randbytes(32)
    seg.table.insert(NS + h)
    seg.close()
    assert reader.closed and reader.lookup(NS, [h]) is None
    assert not os.path.exists(f"/dev/shm/{seg.name}")


def test_open_checks_nonce_size_and_name(seg: IndexSegment) -> None:
    assert IndexReader.open(seg.name, seg.size, b"\0" * 16) is None
    assert IndexReader.open(seg.name, seg.size + 8, seg.nonce) is None
    assert IndexReader.open("../etc/passwd", seg.size, seg.nonce) is None
    assert IndexReader.open("lmcache-svc-index-missing", seg.size, seg.nonce) is None
    segments = [
        pb.Segment(transport="shm", name="arena", size=1, nonce=b""),
        pb.Segment(transport=INDEX_TRANSPORT, name=seg.name, size=seg.size, nonce=seg.nonce),
    ]
    assert list(open_index_segments(segments)) == ["acme"]
    with pytest.raises(InvalidArgument):
        IndexSegment("acme", "cpu", "host_memory", 100)  # not a power of two


def test_reader_mapping_is_read_only(seg: IndexSegment) -> None:
    reader = _reader(seg)
    with pytest.raises(TypeError):
        reader._slots[0] = key_fingerprint(NS + b"x" * 32)  # noqa: SLF001


def test_reader_racing_writer_never_reports_an_absent_key() -> None:
    """A writer churns keys through a small, nearly full table (every removal shifts
    entries) while readers query keys never inserted (must never hit) and keys present
    all along (must never miss when the reader answers at all)."""
    seg = IndexSegment("acme", "cpu", "host_memory", 64)
    rng = random.Random(11)
    stable = _hashes(8, rng)
    churn = _hashes(60, rng)
    never = _hashes(200, rng)
    taken = {key_fingerprint(NS + x) for x in stable + churn}
    never = [h for h in never if key_fingerprint(NS + h) not in taken]
    for h in stable:
        seg.table.insert(NS + h)
    stop = threading.Event()
    errors: list[str] = []
    answered = [0]

    def write() -> None:
        wrng = random.Random(12)
        held: list[bytes] = []
        while not stop.is_set():
            seg.table.beat()
            if len(held) < 38 and wrng.random() < 0.6:
                h = wrng.choice(churn)
                if h not in held and seg.table.insert(NS + h):
                    held.append(h)
            elif held:
                seg.table.remove(NS + held.pop(wrng.randrange(len(held))))

    def read() -> None:
        reader = _reader(seg)
        rrng = random.Random(13)
        for _ in range(4000):
            h = rrng.choice(never)
            answer = reader.lookup(NS, [h])
            if answer is not None and answer.num_hit_chunks:
                errors.append(f"absent key reported: {h.hex()}")
            answer = reader.lookup(NS, stable)
            if answer is not None:
                answered[0] += 1
                if answer.num_hit_chunks != len(stable):
                    errors.append(f"present keys missed: {answer}")

    race(seg, write, read, stop)
    assert not errors, errors[:3]
    assert answered[0] > 1000  # the seqlock rarely gives up


def test_a_killed_server_s_table_is_not_read_in_place() -> None:
    """A server killed by SIGKILL never marks its table closed; its lock goes with it, and
    with the lock no chunk is located or placed for a read in place. A lookup still answers
    from the table (it does not ask for the lock): the client's session, which the kill
    ends, keeps lookups off it (``tests/client/test_session.py``)."""
    seg = IndexSegment("acme", "cpu", "host_memory", 64)
    reader = _reader(seg)
    h = random.Random(6).randbytes(32)
    seg.table.insert(NS + h, PAGE * 3)
    seg.table.beat()
    answer = reader.lookup(NS, [h])
    assert answer is not None and answer.num_hit_chunks == 1
    placement = answer_locally({"acme": reader}, "acme", NS, [h]).placement  # type: ignore[union-attr]
    assert placement is not None and reader.placed(NS, [h], placement) is not None
    # What the kernel does for a killed process: every descriptor closed (the mapping
    # holds a duplicate of the locked one), nothing marked, nothing unlinked.
    seg.table.release()
    seg._buf.release()  # noqa: SLF001
    seg._mm.close()  # noqa: SLF001
    os.close(seg._fd)  # noqa: SLF001
    seg._fd = -1  # noqa: SLF001
    try:
        assert reader.locate(NS, [h]) is None
        assert reader.placed(NS, [h], placement) is None  # a lookup's placement from before
        answer = reader.lookup(NS, [h])
        assert answer is not None and answer.num_hit_chunks == 1
    finally:
        os.unlink(f"/dev/shm/{seg.name}")


def test_a_hung_server_s_table_answers_nothing_once_stale() -> None:
    """A stopped server keeps its lock but no longer stamps its table."""
    seg = IndexSegment("acme", "cpu", "host_memory", 64)
    try:
        reader = _reader(seg)
        h = random.Random(8).randbytes(32)
        seg.table.insert(NS + h)
        seg.table.beat()
        assert reader.lookup(NS, [h]) is not None
        time.sleep(STALE_S + 0.05)
        assert reader.lookup(NS, [h]) is None
        seg.table.beat()  # the server resumes
        answer = reader.lookup(NS, [h])
        assert answer is not None and answer.num_hit_chunks == 1
    finally:
        seg.close()


def test_the_same_hash_in_two_namespaces_is_two_entries(seg: IndexSegment) -> None:
    reader = _reader(seg)
    other = bytes(reversed(NS))
    h, g = _hashes(2, random.Random(7))
    assert seg.table.insert(NS + h)
    assert reader.lookup(NS, [h]).num_hit_chunks == 1  # type: ignore[union-attr]
    assert reader.lookup(other, [h]).num_hit_chunks == 0  # type: ignore[union-attr]
    assert seg.table.insert(other + h) and seg.table.num_entries == 2
    assert seg.table.remove(NS + h)
    assert reader.lookup(NS, [h]).num_hit_chunks == 0  # type: ignore[union-attr]
    assert reader.lookup(other, [h]).num_hit_chunks == 1  # type: ignore[union-attr]
    assert not seg.table.contains(NS + g) and not seg.table.remove(other + g)


@pytest.mark.parametrize(
    ("machine", "supported"),
    [("x86_64", True), ("AMD64", True), ("aarch64", False), ("arm64", False),
     ("ppc64le", False), ("riscv64", False), ("", False)],
)  # fmt: skip
def test_only_x86_64_shares_the_index(
    machine: str, supported: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(platform, "machine", lambda: machine)
    reason = unsupported_cpu_reason()
    assert (reason is None) == supported
    if reason is not None:
        assert repr(machine or "unknown") in reason and "x86-64" in reason


# -- locations: loads without a lease ------------------------------------------------------

PAGE = 4096


def test_locate_gives_every_chunk_s_offset_or_nothing(seg: IndexSegment) -> None:
    reader = _reader(seg)
    hs = _hashes(4, random.Random(21))
    for i, h in enumerate(hs[:3]):
        assert seg.table.insert(NS + h, PAGE * (10 + i))
    located = reader.locate(NS, hs[:3])
    assert located is not None and located.offsets == [PAGE * 10, PAGE * 11, PAGE * 12]
    assert reader.unchanged(located) == 3
    assert reader.locate(NS, hs) is None  # the fourth is not indexed: all or nothing
    seg.table.insert(NS + hs[3])  # indexed without a location (not in the arena)
    assert reader.lookup(NS, hs).num_hit_chunks == 4  # type: ignore[union-attr]
    assert reader.locate(NS, hs) is None
    # Offsets that cannot be located: inside the header, not page-aligned.
    assert location_word(0, 1) == 0 and location_word(PAGE + 8, 1) == 0
    assert location_word(PAGE << 32, 1) == 0  # past 2^32 pages


def test_a_lookup_s_placement_locates_without_reading_the_table_again(seg: IndexSegment) -> None:
    reader = _reader(seg)
    hs = _hashes(4, random.Random(22))
    for i, h in enumerate(hs[:3]):
        assert seg.table.insert(NS + h, PAGE * (20 + i))
    result = answer_locally({"acme": reader}, "acme", NS, hs)
    assert result is not None and result.num_hit_chunks == 3 and result.placement is not None
    placement = result.placement
    assert placement.nonce == seg.nonce and len(placement.locations) == 3
    located = reader.placed(NS, hs[:3], placement)
    assert located is not None and located.offsets == [PAGE * 20, PAGE * 21, PAGE * 22]
    assert reader.unchanged(located) == 3
    assert reader.placed(NS, hs[1:3], placement.part(1, 3)).offsets == [PAGE * 21, PAGE * 22]  # type: ignore[union-attr]
    assert reader.placed(NS, hs[:2], placement) is None  # not these chunks' number
    other = Placement(b"\1" * 16, placement.seq, placement.locations)
    assert reader.placed(NS, hs[:3], other) is None  # another table's (a restarted server)
    seg.table.insert(NS + hs[3])  # indexed, not in the arena: location word 0
    unplaced = answer_locally({"acme": reader}, "acme", NS, hs).placement  # type: ignore[union-attr]
    assert reader.placed(NS, hs, unplaced) is None  # type: ignore[arg-type]
    assert seg.table.remove(NS + hs[1])  # after the lookup: the copy from there is not kept
    assert reader.unchanged(located) == 1


def test_unchanged_counts_entries_kept_through_a_copy(seg: IndexSegment) -> None:
    """Another chunk's insert changes the table but not the located entries; a removal, or
    a removal and a new insert of the same chunk in the same slot, does."""
    reader = _reader(seg)
    a, b, c, other = _hashes(4, random.Random(22))
    for i, h in enumerate((a, b, c)):
        seg.table.insert(NS + h, PAGE * (1 + i))
    located = reader.locate(NS, [a, b, c])
    assert located is not None
    seg.table.insert(NS + other, PAGE * 9)  # the sequence counter moved
    assert reader.unchanged(located) == 3
    seg.table.remove(NS + b)
    seg.table.insert(NS + b, PAGE * 2)  # same chunk, same slot: its bytes may be new
    again = reader.locate(NS, [b])
    assert again is not None and again.offsets == located.offsets[1:2]  # the same page,
    assert again.locations != located.locations[1:2]  # but a new serial
    assert reader.unchanged(located) == 1  # a, then b changed (c is past it)
    seg.table.remove(NS + a)
    assert reader.unchanged(located) == 0


def test_a_fingerprint_match_with_another_check_word_is_no_hit(seg: IndexSegment) -> None:
    """Fingerprint and check word together identify an entry: a key sharing only the first
    64 bits with an indexed chunk is neither found nor located."""
    reader = _reader(seg)
    h = random.Random(23).randbytes(32)
    twin = h[:8] + bytes(x ^ 0xFF for x in h[8:16]) + h[16:]  # same fingerprint
    assert key_fingerprint(NS + twin) == key_fingerprint(NS + h)
    seg.table.insert(NS + h, PAGE * 3)
    assert reader.lookup(NS, [twin]).num_hit_chunks == 0  # type: ignore[union-attr]
    assert reader.locate(NS, [twin]) is None
    assert not seg.table.contains(NS + twin) and not seg.table.remove(NS + twin)
    assert seg.table.insert(NS + twin, PAGE * 4) and seg.table.num_entries == 2
    located = reader.locate(NS, [h, twin])
    assert located is not None and located.offsets == [PAGE * 3, PAGE * 4]


def test_a_refused_chunk_keeps_its_location_until_indexed(seg: IndexSegment) -> None:
    hs = _hashes(seg.table.max_entries + 1, random.Random(24))
    for i, h in enumerate(hs):
        seg.table.insert(NS + h, PAGE * (1 + i))
    assert not seg.table.contains(NS + hs[-1])
    seg.table.remove(NS + hs[0])
    located = _reader(seg).locate(NS, [hs[-1]])
    assert located is not None and located.offsets == [PAGE * len(hs)]


def test_readers_racing_the_writer_never_keep_a_moved_chunk() -> None:
    """The writer moves chunks between pages (remove, insert elsewhere or in the same page
    again) and records, per page, a write counter bumped while no entry names the page (as
    the server frees a slot only after removing its entry). A reader that locates a chunk,
    reads the page's counter twice around a pause (its "copy"), and finds the entry
    unchanged must have seen the counter unchanged: the page was not rewritten meanwhile."""
    seg = IndexSegment("acme", "cpu", "host_memory", 64)
    rng = random.Random(25)
    chunks = _hashes(30, rng)
    writes = [0] * 64  # per page: bumped only while no entry points at the page
    stop = threading.Event()
    errors: list[str] = []
    kept = [0]

    def write() -> None:
        wrng = random.Random(26)
        where: dict[bytes, int] = {}
        free = list(range(1, 64))
        while not stop.is_set():
            seg.table.beat()
            h = wrng.choice(chunks)
            if h in where:
                seg.table.remove(NS + h)
                page = where.pop(h)
                writes[page] += 1  # the slot is freed and rewritten by another store
                free.append(page)
            elif len(where) < 40:
                page = free.pop(wrng.randrange(len(free)))
                where[h] = page
                seg.table.insert(NS + h, PAGE * page)

    def read() -> None:
        reader = _reader(seg)
        rrng = random.Random(27)
        for _ in range(3000):
            h = rrng.choice(chunks)
            located = reader.locate(NS, [h])
            if located is None:
                continue
            page = located.offsets[0] // PAGE
            before = writes[page]
            time.sleep(0)  # the copy: let the writer run
            after = writes[page]
            if reader.unchanged(located) == 1:
                kept[0] += 1
                if after != before:
                    errors.append(f"page {page} rewritten during a copy kept as good")

    race(seg, write, read, stop)
    assert not errors, errors[:3]
    assert kept[0] > 100  # most copies are kept

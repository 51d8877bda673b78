"""A read-only lookup index in shared memory: which chunks the first tier holds.

The server publishes, per tenant, a fixed-size open-addressing table of 64-bit chunk
fingerprints in its own POSIX shared-memory segment; a client on the same host maps it
read-only and answers ``Lookup`` without a round trip (``shm.index_reader.IndexReader``). The server
is the only writer (``server.index_publisher``, every write under the publisher's lock);
readers take no lock.

Layout (native little-endian uint64 words):

- bytes 0-4095, the header: word 0 ``MAGIC``, words 1-2 a random nonce (the client checks
  it against the one its session announced), word 3 the number of slots (a power of two),
  word 4 the sequence counter, word 5 the number of entries, word 6 flags, word 7 the
  server's heartbeat (``CLOCK_MONOTONIC`` in ns, one clock for every process of a host),
  then the tenant (``TENANT_OFFSET``, length-prefixed UTF-8), the first tier's name
  (``TIER_OFFSET``) and its medium (``MEDIUM_OFFSET``, ``Tier.medium``);
- then three words per slot (``SLOT_WORDS``): the fingerprint, 0 for an empty slot, else a
  word of the chunk's namespace and hash (the first 8 bytes of the chunk hash, a sha256
  digest, XOR the first 8 of the namespace id; 0 is stored as 1); the check word, the next 8
  bytes of each; and the location, where the chunk's bytes are in the arena the session
  mapped (``location_word``: the slot's 4096-byte page and a serial number the table gives
  each insert), 0 when the first tier is not that arena. The namespace is part of the key:
  the same chunk hash in two namespaces of one tenant is two entries, so a chunk of one is
  never a hit in the other, and deleting it from one leaves the other's.

Linear probing; removal shifts the following entries back (no tombstones), so a table never
degrades. An insert past ``MAX_LOAD`` is refused and the table marks itself
``FLAG_INCOMPLETE`` until every refused chunk is indexed (as removals make room) or gone.

Readers and the writer: a sequence lock. The writer makes the counter odd before it changes
any slot and even again after; a reader that saw an odd counter, or a different counter
after its probes, retries (a few times, then gives up: the caller asks the server). Every
word is one aligned 8-byte load or store, so a reader sees a slot's old or new value, never
a mix: a fingerprint it finds was written by the server for some chunk (no key that was
never inserted is reported). Fingerprint and check word together are 128 bits of the key:
a chunk that was never inserted matches an entry with probability about 2^-108 with a
million chunks indexed.

Loads without a lease (``index_reader.IndexReader.locate``, then ``unchanged`` after the
copy): a reader copies a located chunk's bytes from the arena without pinning it, then
checks that its entry is still there with the same location word. The server removes a
chunk's entry (under the cache's lock, ``cache.first_tier_slots``) before its slot can be
freed, and a readable chunk's bytes never change in place; so if the entry is unchanged
after the copy (the sequence counter unchanged, or the same location word found again),
the slot was not freed, and not rewritten, while the copy read it. The serial number in the
location word tells a chunk removed and stored again in the same slot (its bytes may have
been rewritten meanwhile) from one that stayed. A chunk that changed is loaded again under a
lease, or recomputed.

The ordering argument needs the x86-64 memory model: another core sees the writer's stores
in program order (the counter made odd before the slot changes, the slot before the counter
made even) and the reader's loads are not reordered either. Nothing here issues a memory
barrier (Python has none to issue), so on a weakly ordered CPU (ARM, POWER, RISC-V) a reader
could see a slot change with the counter unchanged. There the index is not used at all
(``unsupported_cpu_reason``): the server publishes no tables and a client maps none it is
offered; lookups go to the server over gRPC, with one warning saying why.

A miss is final only when the table is complete: ``FLAG_INCOMPLETE`` (overflow) or
``FLAG_LOWER_TIERS`` (the server has tiers below the arena, whose chunks are hits for
``Lookup`` but are not indexed here) make a short answer ``None``, and the client asks the
server. ``FLAG_CLOSED``: the server stopped; nothing here is current any more. A server
that was killed cannot say so: its clients' sessions end, after which they read none of its
tables, and a read in place (``locate``, ``placed``) finds the segment's lock (held by the
server for its lifetime, as the arena's is) free and reads nothing (a lookup does not ask
for the lock: a system call on every cold lookup). A server that hangs
(SIGSTOP, a stuck process) stops stamping its heartbeat; ``STALE_S`` later its tables
answer nothing and the client's gRPC Lookup meets its deadline, as without the index.
"""

from __future__ import annotations

import platform
import secrets
import time

from lmcache_svc.errors import InvalidArgument
from lmcache_svc.keys import NAMESPACE_ID_BYTES
from lmcache_svc.tiers.base import MEDIA, Medium

MAGIC = int.from_bytes(b"LMCSVCI4", "little")  # 4: check words and locations
HEADER_BYTES = 4096
W_MAGIC, W_NONCE0, W_NONCE1, W_SLOTS, W_SEQ, W_COUNT, W_FLAGS, W_BEAT = range(8)
TENANT_OFFSET = 64
TENANT_MAX_BYTES = 1024
TIER_OFFSET = TENANT_OFFSET + 8 + TENANT_MAX_BYTES
TIER_MAX_BYTES = 256
MEDIUM_OFFSET = TIER_OFFSET + 8 + TIER_MAX_BYTES
MEDIUM_MAX_BYTES = 64
FLAG_LOWER_TIERS = 1
FLAG_INCOMPLETE = 2
FLAG_CLOSED = 4
MAX_LOAD = 0.75
MAX_READ_TRIES = 64
SLOT_WORDS = 3
"""Words per table slot: fingerprint, check word, location."""
PAGE_BYTES = 4096
"""The arena's slot alignment (``shm.slab.ALIGN``): a location counts pages of it."""
BEAT_S = 0.02
"""How often the server stamps each table (``IndexTable.beat``)."""
STALE_S = 0.25
"""A table whose stamp is older than this is not answered from (a hung server)."""
STALE_NS = int(STALE_S * 1e9)
INDEX_TRANSPORT = "shm-index"
"""``Segment.transport`` of an index segment in the session's first event."""
ORDERED_MACHINES = frozenset({"x86_64", "AMD64"})
"""``platform.machine()`` of the CPUs whose memory model the sequence lock relies on."""


def unsupported_cpu_reason() -> str | None:
    """Why this host's CPU cannot share the index lock-free, or None when it can (x86-64)."""
    machine = platform.machine()
    if machine in ORDERED_MACHINES:
        return None
    return (
        f"the CPU is {machine or 'unknown'!r}, not x86-64: the index's lock-free reads rely "
        "on x86-64 store ordering"
    )


def namespace_word(namespace_id: bytes) -> int:
    """What a namespace adds to its chunks' fingerprints."""
    return int.from_bytes(namespace_id[:8], "little")


def fingerprint(namespace_word: int, chunk_hash: bytes) -> int:
    """The 64-bit word that stands for a chunk of a namespace in the table (never 0, the
    empty mark)."""
    return (int.from_bytes(chunk_hash[:8], "little") ^ namespace_word) or 1


def namespace_check_word(namespace_id: bytes) -> int:
    """What a namespace adds to its chunks' check words."""
    return int.from_bytes(namespace_id[8:16], "little")


def check_word(namespace_check: int, chunk_hash: bytes) -> int:
    """The second word of a chunk's key in the table (any value)."""
    return int.from_bytes(chunk_hash[8:16], "little") ^ namespace_check


def key_fingerprint(key: bytes) -> int:
    """The fingerprint of a chunk key (namespace id, then chunk hash)."""
    return fingerprint(namespace_word(key[:NAMESPACE_ID_BYTES]), key[NAMESPACE_ID_BYTES:])


def key_words(key: bytes) -> tuple[int, int]:
    """A chunk key's fingerprint and check word."""
    ns, chunk_hash = key[:NAMESPACE_ID_BYTES], key[NAMESPACE_ID_BYTES:]
    fp = fingerprint(namespace_word(ns), chunk_hash)
    return fp, check_word(namespace_check_word(ns), chunk_hash)


def location_word(offset: int, serial: int) -> int:
    """A location: the slot's page in the arena (low 32 bits) and the insert's serial number
    (high 32 bits); 0 (no location) for an offset that is not a page boundary after the
    header or lies past 2^32 pages."""
    page, rest = divmod(offset, PAGE_BYTES)
    if rest or not 0 < page < 1 << 32:
        return 0
    return (serial & 0xFFFFFFFF) << 32 | page


def location_offset(word: int) -> int:
    """The arena offset a location word names."""
    return (word & 0xFFFFFFFF) * PAGE_BYTES


def segment_bytes(num_slots: int) -> int:
    return HEADER_BYTES + 8 * SLOT_WORDS * num_slots


def check_num_slots(num_slots: int) -> int:
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 8:
        raise InvalidArgument(f"index slots must be an integer >= 8, got {num_slots!r}")
    if num_slots & (num_slots - 1):
        raise InvalidArgument(f"index slots must be a power of two, got {num_slots}")
    return num_slots


def _put_text(buf: memoryview, offset: int, limit: int, text: str) -> None:
    data = text.encode()
    if len(data) > limit:
        raise InvalidArgument(f"{text[:40]!r}... is over {limit} bytes")
    buf[offset : offset + 8] = len(data).to_bytes(8, "little")
    buf[offset + 8 : offset + 8 + len(data)] = data


def get_text(buf: memoryview, offset: int, limit: int) -> str | None:
    length = int.from_bytes(buf[offset : offset + 8], "little")
    if length > limit:
        return None
    try:
        return bytes(buf[offset + 8 : offset + 8 + length]).decode()
    except UnicodeDecodeError:
        return None


def get_medium(buf: memoryview) -> Medium | None:
    """The header's medium, or None for one this reader does not know."""
    text = get_text(buf, MEDIUM_OFFSET, MEDIUM_MAX_BYTES)
    for medium in MEDIA:
        if text == medium:
            return medium
    return None


class IndexTable:
    """The writer: one table over a writable buffer. Not thread-safe: every call is made
    under one lock (``server.index_publisher``: the publisher's), so there is one writer."""

    def __init__(
        self, buf: memoryview, num_slots: int, tenant: str, tier_name: str, medium: Medium
    ) -> None:
        check_num_slots(num_slots)
        if len(buf) != segment_bytes(num_slots):
            need = segment_bytes(num_slots)
            raise InvalidArgument(f"index buffer is {len(buf)} bytes, need {need}")
        self._buf = buf
        self._words = buf.cast("Q")
        self._slots = self._words[HEADER_BYTES // 8 :]
        self._mask = num_slots - 1
        self.num_slots = num_slots
        self.max_entries = int(num_slots * MAX_LOAD)
        self.nonce = secrets.token_bytes(16)
        self._refused: dict[tuple[int, int], int] = {}  # key words -> location
        self._count = 0
        self._serial = 0
        _put_text(buf, TENANT_OFFSET, TENANT_MAX_BYTES, tenant)
        _put_text(buf, TIER_OFFSET, TIER_MAX_BYTES, tier_name)
        _put_text(buf, MEDIUM_OFFSET, MEDIUM_MAX_BYTES, medium)
        w = self._words
        w[W_NONCE0] = int.from_bytes(self.nonce[:8], "little")
        w[W_NONCE1] = int.from_bytes(self.nonce[8:], "little")
        w[W_SLOTS], w[W_SEQ], w[W_COUNT], w[W_FLAGS] = num_slots, 0, 0, 0
        w[W_BEAT] = time.monotonic_ns()
        w[W_MAGIC] = MAGIC  # last: a reader never trusts a half-written header

    @property
    def num_entries(self) -> int:
        return self._count

    @property
    def complete(self) -> bool:
        return not self._refused

    def _begin(self) -> None:
        self._words[W_SEQ] += 1  # odd: writing

    def _end(self) -> None:
        self._words[W_COUNT] = self._count
        self._words[W_SEQ] += 1

    def _set_flag(self, flag: int, on: bool) -> None:
        w = self._words
        w[W_FLAGS] = (w[W_FLAGS] | flag) if on else (w[W_FLAGS] & ~flag)

    def set_lower_tiers(self, on: bool) -> None:
        """Whether a chunk missing here may still be a hit (in a tier below the arena)."""
        self._set_flag(FLAG_LOWER_TIERS, on)

    def beat(self) -> None:
        """Stamp the table: the server is alive and keeps it current."""
        self._words[W_BEAT] = time.monotonic_ns()

    def mark_closed(self) -> None:
        self._set_flag(FLAG_CLOSED, True)

    def _find(self, fp: int, check: int) -> int | None:
        """The table slot holding the key words, or None."""
        slots, mask = self._slots, self._mask
        i = fp & mask
        while True:
            word = slots[SLOT_WORDS * i]
            if word == fp and slots[SLOT_WORDS * i + 1] == check:
                return i
            if word == 0:
                return None
            i = (i + 1) & mask

    def insert(self, key: bytes, offset: int | None = None) -> bool:
        """Index a chunk (its key: namespace id, then chunk hash), with the arena ``offset``
        of its bytes when the first tier is the sessions' arena; False when the table is full
        (it is then marked incomplete)."""
        words = key_words(key)
        if self._find(*words) is not None:
            return True  # already there
        self._serial += 1
        loc = 0 if offset is None else location_word(offset, self._serial)
        if self._count >= self.max_entries:
            if words not in self._refused:
                self._refused[words] = loc
                self._set_flag(FLAG_INCOMPLETE, True)
            return False
        self._place(words, loc)
        return True

    def _place(self, words: tuple[int, int], loc: int) -> None:
        slots, mask = self._slots, self._mask
        i = words[0] & mask
        while slots[SLOT_WORDS * i] != 0:
            i = (i + 1) & mask
        j = SLOT_WORDS * i
        self._begin()
        slots[j + 1], slots[j + 2] = words[1], loc
        slots[j] = words[0]  # last: a slot with its fingerprint is whole
        self._count += 1
        self._end()

    def _take_refused(self) -> None:
        """Room again: index a chunk refused while the table was full."""
        while self._refused and self._count < self.max_entries:
            words, loc = self._refused.popitem()
            if self._find(*words) is None:
                self._place(words, loc)
        if not self._refused:
            self._set_flag(FLAG_INCOMPLETE, False)

    def remove(self, key: bytes) -> bool:
        """Drop a chunk (backward-shift deletion); False if it was not indexed."""
        words = key_words(key)
        if self._refused.pop(words, None) is not None:
            if not self._refused:
                self._set_flag(FLAG_INCOMPLETE, False)
            return False
        i = self._find(*words)
        if i is None:
            return False
        slots, mask = self._slots, self._mask
        self._begin()
        try:
            j = i
            while True:
                j = (j + 1) & mask
                word = slots[SLOT_WORDS * j]
                if word == 0:
                    break
                home = word & mask
                # Move slot ``j`` into the hole at ``i`` unless its home lies in (i, j].
                if (j > i and (home <= i or home > j)) or (j < i and i >= home > j):
                    a, b = SLOT_WORDS * i, SLOT_WORDS * j
                    slots[a : a + SLOT_WORDS] = slots[b : b + SLOT_WORDS]
                    i = j
            a = SLOT_WORDS * i
            slots[a : a + SLOT_WORDS] = _EMPTY_SLOT
            self._count -= 1
        finally:
            self._end()
        if self._refused:
            self._take_refused()
        return True

    def contains(self, key: bytes) -> bool:
        return self._find(*key_words(key)) is not None

    def release(self) -> None:
        self._slots.release()
        self._words.release()


_EMPTY_SLOT = memoryview(bytes(8 * SLOT_WORDS)).cast("Q")

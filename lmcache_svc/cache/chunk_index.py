"""The first tier's chunk index: which chunks have a slot, in what state, in LRU order.

An index of millions of chunks must stay small (``bench scale`` measures bytes per chunk),
so a chunk at rest (committed, not pinned, not being deleted) is held as ``None``: no state
beyond its place in the LRU order, its slot being the tier's to tell (``slot_of``). A chunk
in flux (reserved, being promoted, pinned by a lease or a copy, or deleted while pinned)
gets an ``Entry`` with its state for that time, dropped again once the chunk is at rest
again (``_forget_if_at_rest``). The order is
least recently used first.

Reservations are counted per owner (``owned_bytes``) and per tenant (``tenant_bytes``, for
the reservations made with one), and a reservation that passed its
deadline is *quarantined* rather than freed: its writer (a client holding a view of the slot
in shared memory, or an inline upload) may still be writing, so the slot stays out of
circulation, the key stays busy, and only its owner's commit or abort, or the end of its
session, gives the slot back. A quarantined entry never becomes readable.

Not locked itself: the cache's lock guards every call, and this is the only code that
changes its entries (pins, deleted flags, deadlines, keys being demoted): callers read an
``Entry``, never write it. Its one owner, ``first_tier_slots.FirstTierSlots``, is the only
code that calls its changing methods. With ``check_lock`` (default: the
``LMCACHE_CHECK_LOCKS`` environment variable set to 1, as the test suite does) every method
that changes the index raises ``RuntimeError`` when the calling thread does not hold the
lock it was given.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from lmcache_svc.keys import ChunkKey
from lmcache_svc.tiers.base import Slot

K = TypeVar("K")
CHECK_LOCKS_ENV = "LMCACHE_CHECK_LOCKS"
"""Set to 1 to check, in every index change, that the cache's lock is held (debugging)."""


@dataclass(slots=True)
class Entry:
    """A chunk in flux."""

    slot: Slot
    ready: bool
    owner: str | None = None
    deadline: float = 0.0
    pins: int = 0
    deleted: bool = False
    """Deleted while pinned: freed when the last pin goes."""
    expired: bool = False
    """A reservation past its deadline, quarantined until its owner lets go of it."""
    tenant: str | None = None
    """The tenant a reservation counts against (None: promotions, the server's own)."""

    @property
    def at_rest(self) -> bool:
        return self.ready and self.pins == 0 and not self.deleted


class ChunkIndex:
    def __init__(
        self,
        tier_slot_of: Callable[[ChunkKey], Slot | None],
        lock: threading.RLock | None = None,
        *,
        check_lock: bool | None = None,
    ) -> None:
        self._tier_slot_of = tier_slot_of
        self._lock = lock
        if check_lock is None:
            check_lock = os.environ.get(CHECK_LOCKS_ENV) == "1"
        self._check_lock = check_lock and lock is not None
        self._items: OrderedDict[ChunkKey, Entry | None] = OrderedDict()  # None: at rest
        self._pending: set[ChunkKey] = set()  # not ready yet: reserved or being promoted
        self._quarantined: dict[ChunkKey, str | None] = {}  # expired reservation -> owner
        self._owned_bytes: dict[str | None, int] = {}  # reserved + quarantined, per owner
        self._tenant_bytes: dict[str, int] = {}  # the same, per tenant
        self._demoting: set[ChunkKey] = set()  # removed, bytes being demoted (not yet freed)
        self.on_change: Callable[[ChunkKey, bool], None] | None = None
        """Told when a chunk becomes readable (True) or stops being so (the lookup index)."""

    def _locked(self, what: str) -> None:
        """Raise unless the calling thread holds the cache's lock (only with ``check_lock``)."""
        if self._lock is not None and not self._lock._is_owned():  # type: ignore[attr-defined]
            raise RuntimeError(f"ChunkIndex.{what} called without the cache's lock held")

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def busy(self, key: ChunkKey) -> bool:
        """True when ``key`` has an entry or is being demoted: no new slot for it now."""
        return key in self._items or key in self._demoting

    def entry(self, key: ChunkKey) -> Entry | None:
        """The key's state while it is in flux (None for a chunk at rest or absent)."""
        return self._items.get(key)

    def readable(self, key: ChunkKey) -> bool:
        """True for a committed chunk that is not being deleted."""
        items = self._items
        value = items.get(key)
        if value is None:
            return key in items
        return value.ready and not value.deleted

    def slot_of(self, key: ChunkKey) -> Slot:
        value = self._items[key]
        if value is not None:
            return value.slot
        slot = self._tier_slot_of(key)
        if slot is None:
            raise RuntimeError(f"chunk {key.hex()} is indexed but its tier has no slot for it")
        return slot

    def reserve(
        self,
        key: ChunkKey,
        slot: Slot,
        owner: str | None,
        deadline: float,
        tenant: str | None = None,
    ) -> None:
        if self._check_lock:
            self._locked("reserve")
        self._items[key] = Entry(slot, ready=False, owner=owner, deadline=deadline, tenant=tenant)
        self._pending.add(key)
        self._owned_bytes[owner] = self._owned_bytes.get(owner, 0) + slot.length
        if tenant is not None:
            self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + slot.length

    def mark_ready(self, key: ChunkKey, entry: Entry) -> None:
        if self._check_lock:
            self._locked("mark_ready")
        if entry.expired:
            raise RuntimeError(f"chunk {key.hex()}: an expired reservation cannot be committed")
        self._disown(entry)
        entry.ready, entry.owner = True, None
        self._pending.discard(key)
        self._forget_if_at_rest(key, entry)
        if self.on_change is not None:
            self.on_change(key, True)

    def rekey(self, old: ChunkKey, new: ChunkKey) -> Entry:
        """Move a live reservation to another key (a pooled slot becomes the chunk written
        into it): owner, deadline and slot are kept, ``new`` goes to the recent end."""
        if self._check_lock:
            self._locked("rekey")
        entry = self._items.get(old)
        if entry is None or entry.ready or entry.expired or new in self._items:
            raise RuntimeError(f"chunk {old.hex()}: only a live reservation can be rekeyed")
        del self._items[old]
        self._pending.discard(old)
        self._items[new] = entry
        self._pending.add(new)
        return entry

    def quarantine(self, key: ChunkKey, entry: Entry) -> None:
        """An expired reservation: no longer pending, never committable, slot kept."""
        if self._check_lock:
            self._locked("quarantine")
        entry.expired = True
        self._pending.discard(key)
        self._quarantined[key] = entry.owner

    def quarantined_of(self, owner: str | None) -> list[ChunkKey]:
        return [k for k, o in self._quarantined.items() if o == owner]

    def owned_bytes(self, owner: str | None) -> int:
        """Bytes of the slots ``owner`` holds reserved, quarantined ones included."""
        return self._owned_bytes.get(owner, 0)

    def tenant_bytes(self, tenant: str) -> int:
        """Bytes of the slots reserved for ``tenant``, quarantined ones included."""
        return self._tenant_bytes.get(tenant, 0)

    @property
    def quarantined_bytes(self) -> int:
        items = self._items
        return sum(e.slot.length for k in self._quarantined if (e := items[k]) is not None)

    def _disown(self, entry: Entry) -> None:
        if entry.ready:
            return
        _take(self._owned_bytes, entry.owner, entry.slot.length)
        if entry.tenant is not None:
            _take(self._tenant_bytes, entry.tenant, entry.slot.length)

    def _forget_if_at_rest(self, key: ChunkKey, entry: Entry) -> None:
        """Back to the bare slot once the chunk is at rest (its LRU position is kept)."""
        if self._check_lock:
            self._locked("_forget_if_at_rest")
        if entry.at_rest:
            self._items[key] = None

    def pin(self, key: ChunkKey) -> None:
        if self._check_lock:
            self._locked("pin")
        entry = self._items[key]
        if entry is None:
            entry = self._items[key] = Entry(self.slot_of(key), ready=True)
        entry.pins += 1

    def unpin(self, key: ChunkKey) -> bool:
        """Drop one pin; True when that was the last pin of a chunk deleted while pinned (the
        caller frees it now), else the entry is dropped if the chunk is at rest again."""
        if self._check_lock:
            self._locked("unpin")
        entry = self._items.get(key)
        if entry is None or entry.pins <= 0:
            raise RuntimeError(f"unpin of chunk {key.hex()} that is not pinned")
        entry.pins -= 1
        if entry.pins == 0 and entry.deleted:
            return True
        self._forget_if_at_rest(key, entry)
        return False

    def mark_deleted(self, key: ChunkKey) -> None:
        """Deleted (or found corrupted) while pinned: freed when its last pin goes. A chunk
        without an entry (at rest or absent) is left alone."""
        if self._check_lock:
            self._locked("mark_deleted")
        entry = self._items.get(key)
        if entry is not None:
            entry.deleted = True
            if self.on_change is not None:
                self.on_change(key, False)

    def extend_deadline(self, key: ChunkKey, deadline: float) -> None:
        """Move a reservation's deadline to ``deadline``, never earlier."""
        if self._check_lock:
            self._locked("extend_deadline")
        entry = self._items[key]
        if entry is None:
            raise RuntimeError(f"chunk {key.hex()} has no reservation to extend")
        entry.deadline = max(entry.deadline, deadline)

    def touch(self, key: ChunkKey) -> None:
        if self._check_lock:
            self._locked("touch")
        self._items.move_to_end(key)

    def remove_for_demotion(self, key: ChunkKey) -> Slot:
        """Remove an evicted chunk whose bytes are being demoted: the key stays busy (no new
        slot for it) until ``end_demotion``."""
        slot = self.remove(key)
        self._demoting.add(key)
        return slot

    def end_demotion(self, key: ChunkKey) -> None:
        """The demotion of a chunk removed by ``remove_for_demotion`` is over (its slot is
        freed by the caller): the key may get a new slot again."""
        if self._check_lock:
            self._locked("end_demotion")
        self._demoting.discard(key)

    def remove(self, key: ChunkKey) -> Slot:
        if self._check_lock:
            self._locked("remove")
        slot = self.slot_of(key)
        entry = self._items.pop(key)
        if self.on_change is not None and (entry is None or entry.ready):
            self.on_change(key, False)
        if entry is not None:
            self._disown(entry)
        self._pending.discard(key)
        self._quarantined.pop(key, None)
        return slot

    def pending(self) -> Iterator[tuple[ChunkKey, Entry]]:
        """Entries not ready yet (reserved or being promoted), as a snapshot."""
        items = self._items
        for key in list(self._pending):
            entry = items[key]
            if entry is None:
                raise RuntimeError(f"pending chunk {key.hex()} has no entry")
            yield key, entry

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def least_recent_at_rest(self, nbytes: int) -> list[tuple[ChunkKey, Slot]]:
        """The least recently used chunks at rest whose slots add up to ``nbytes`` or more."""
        victims: list[tuple[ChunkKey, Slot]] = []
        freed = 0
        for key, entry in self._items.items():
            if freed >= nbytes:
                break
            if entry is not None and not entry.at_rest:
                continue
            slot = self.slot_of(key)
            victims.append((key, slot))
            freed += slot.length
        return victims


def _take(counts: dict[K, int], name: K, nbytes: int) -> None:
    left = counts[name] - nbytes
    if left:
        counts[name] = left
    else:
        del counts[name]

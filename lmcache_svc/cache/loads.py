"""The tiered cache's load path: pin the longest available prefix under a lease
(``prepare_load``, promoting from lower tiers), unpin it (``release_load``); the inline
``get``. A pinned chunk is never evicted, demoted or freed."""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_svc.cache.core import CacheCore
from lmcache_svc.cache.values import LeasedSlots
from lmcache_svc.keys import ChunkKey, Namespace


class LoadPath:
    def __init__(self, core: CacheCore) -> None:
        self._core = core

    def prepare_load(
        self,
        namespace_id: bytes,
        chunk_hashes: Sequence[bytes],
        *,
        session_id: str | None = None,
        ttl_s: float | None = None,
        verify: bool = False,
    ) -> LeasedSlots:
        """Pin the longest available prefix in the first tier, promoting from lower tiers;
        with ``verify``, only the leading chunks whose bytes match their checksums."""
        core = self._core
        keys = core.namespaces.keys(namespace_id, chunk_hashes)
        ns = core.namespaces.get(namespace_id)
        sessions = core.sessions
        # Checked before anything is pinned: a bad ttl must not leave pins behind.
        s = core.settings
        deadline = sessions.deadline(ttl_s, s.lease_ttl_s, s.max_lease_ttl_s)
        sessions.charge_lease(ns.tenant, session_id, len(keys))  # the tenant's quota
        lease: LeasedSlots | None = None
        try:
            lease = self._pin_prefix(keys, ns, session_id, deadline, verify)
        finally:
            if lease is None or lease.lease_id is None:
                sessions.uncharge_lease(ns.tenant, session_id, len(keys))
        return lease

    def _pin_prefix(
        self,
        keys: list[ChunkKey],
        ns: Namespace,
        session_id: str | None,
        deadline: float,
        verify: bool,
    ) -> LeasedSlots:
        core = self._core
        with core.lock:
            pinned = core.slots.pin_prefix(keys)
        sources = [core.first.name] * len(pinned)
        if len(pinned) < len(keys):
            promoted, promoted_from = core.moves.promote(keys[len(pinned) :], ns.chunk_bytes)
            core.checksummer.submit(promoted)
            pinned += promoted
            sources += promoted_from
        if verify:
            pinned, sources = self._verified(pinned, sources)
        if not pinned:
            return LeasedSlots(None)
        with core.lock:
            lease_id = core.sessions.grant(pinned, session_id, deadline, ns.tenant, len(keys))
            slots = [core.slots.slot_of(k) for k in pinned]
        for slot, name in zip(slots, sources):
            core.metrics.bytes_read.labels(tier=name).inc(slot.length)
        return LeasedSlots(lease_id, slots, sources)

    def _verified(
        self, pinned: list[ChunkKey], sources: list[str]
    ) -> tuple[list[ChunkKey], list[str]]:
        """The intact prefix of pinned chunks; the rest are unpinned (a corrupted one is
        dropped, so a later load may promote a good copy from a lower tier)."""
        num = self._core.moves.verified_prefix(pinned)
        self._core.slots.unpin_all(pinned[num:])
        return pinned[:num], sources[:num]

    def release_load(self, lease_id: str) -> bool:
        return self._core.sessions.release(lease_id)

    def touch(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> int:
        """Chunks a client read in place without a lease (``shm.lookup_index``): the ones
        still in the first tier become the most recently used, and their bytes count as
        read from it, as a lease's would; returns how many."""
        core = self._core
        keys = core.namespaces.keys(namespace_id, chunk_hashes)
        num = nbytes = 0
        with core.lock:
            for key in keys:
                if core.slots.readable(key):
                    core.slots.touch(key)
                    nbytes += core.slots.slot_of(key).length
                    num += 1
        if nbytes:
            core.metrics.bytes_read.labels(tier=core.first.name).inc(nbytes)
        return num

    def get(
        self, namespace_id: bytes, chunk_hash: bytes, *, verify: bool = False
    ) -> tuple[bytes, str] | None:
        """One chunk's bytes and the tier it was found in, or None (with ``verify``, also
        when its bytes differ from its checksum: the chunk is then dropped)."""
        lease = self.prepare_load(namespace_id, [chunk_hash], verify=verify)
        if lease.lease_id is None:
            return None
        try:
            return bytes(self._core.first.view(lease.slots[0])), lease.source_tiers[0]
        finally:
            self.release_load(lease.lease_id)

"""The tiered cache's store path: reserve slots (``prepare_store``), publish them
(``commit_store``) or give them back (``abort_store``); the inline ``put``; a server-side
writer's ``renew_store``; and ``delete`` from every tier.

A reservation is owned by a session (or a session-less caller) and has a deadline; one
owner holds at most ``max_reserved_fraction`` of the first tier, one tenant at most
``max_tenant_reserved_fraction`` (``quotas.py``). Past its deadline a
reservation is quarantined, never reused while its writer may still write: a late commit
publishes nothing (it answers 0 and frees the slot). A commit queues the chunks' checksums
and write-through copies and wakes maintenance above the high watermark.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from lmcache_svc.cache.core import CacheCore
from lmcache_svc.cache.values import PreparedStore, StoreStatus
from lmcache_svc.errors import ReservationExpired, SizeMismatch
from lmcache_svc.keys import ChunkHash, ChunkKey, make_chunk_keys
from lmcache_svc.tiers.base import Buffer, Slot

if TYPE_CHECKING:
    from lmcache_svc.server.events.meta import ChunkMeta


class StorePath:
    def __init__(self, core: CacheCore) -> None:
        self._core = core

    def prepare_store(
        self,
        namespace_id: bytes,
        chunk_hashes: Sequence[bytes],
        *,
        session_id: str | None = None,
        ttl_s: float | None = None,
    ) -> list[PreparedStore]:
        core = self._core
        keys = core.namespaces.keys(namespace_id, chunk_hashes)
        ns = core.namespaces.get(namespace_id)
        nbytes = ns.chunk_bytes
        s = core.settings
        deadline = core.sessions.deadline(ttl_s, s.reservation_ttl_s, s.max_reservation_ttl_s)
        charged = len(keys) * nbytes
        with core.lock:  # the session's and the tenant's shares (quotas.py)
            core.reservations.charge(session_id, ns.tenant, charged, nbytes)
        try:
            out: list[PreparedStore] = []
            for key, h in zip(keys, chunk_hashes):
                status, slot = self._reserve(key, nbytes, session_id, deadline, ns.tenant)
                out.append(PreparedStore(ChunkHash(bytes(h)), status, slot))
        finally:
            with core.lock:
                core.reservations.uncharge(session_id, ns.tenant, charged)
        core.update_pending()
        return out

    def _reserve(
        self, key: ChunkKey, nbytes: int, owner: str | None, deadline: float, tenant: str
    ) -> tuple[StoreStatus, Slot | None]:
        core = self._core
        with core.lock:
            if core.slots.readable(key):
                core.slots.touch(key)
                return "already_stored", None
            if core.slots.busy(key):  # reserved, promoting, deleted while pinned, demoting
                return "in_progress", None
            if core.lower.local_tier(key) is not None:
                return "already_stored", None
        slot = core.moves.allocate(key, nbytes, owner, deadline, tenant)
        return ("reserved", slot) if slot is not None else ("no_space", None)

    def commit_store(
        self,
        namespace_id: bytes,
        chunk_hashes: Sequence[bytes],
        *,
        session_id: str | None = None,
        token_ids: bytes = b"",
        parent_hashes: Sequence[bytes] = (),
    ) -> int:
        """Publish reserved chunks; ``token_ids`` and ``parent_hashes`` (optional, checked
        against the hashes) describe them for the KV events (``server/events/meta.py``)."""
        namespaces = self._core.namespaces
        keys = namespaces.keys(namespace_id, chunk_hashes)
        metas = namespaces.describe(namespace_id, keys, chunk_hashes, token_ids, parent_hashes)
        return self.commit_keys(keys, session_id, metas)

    def commit_keys(
        self,
        keys: Sequence[ChunkKey],
        session_id: str | None,
        metas: Mapping[ChunkKey, ChunkMeta] | None = None,
    ) -> int:
        """Publish ``session_id``'s live reservations among ``keys``; how many. Takes the
        lock; the checksums and write-through copies are queued, maintenance woken above the
        high watermark."""
        core = self._core
        listener, written = core.listener, core.metrics.bytes_written.labels(tier=core.first.name)
        committed: list[ChunkKey] = []
        with core.lock:
            for key in keys:
                entry = core.slots.live_reservation(key, session_id)
                if entry is None:
                    continue
                if metas and listener is not None and key in metas:
                    listener.chunk_described(key, metas[key])
                core.slots.commit(key, entry)
                written.inc(entry.slot.length)
                committed.append(key)
        core.update_pending()
        core.checksummer.submit(committed)
        core.write_through.submit(committed)
        core.wake_if_above_watermark()
        return len(committed)

    def abort_store(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], *, session_id: str | None = None
    ) -> int:
        core = self._core
        keys = core.namespaces.keys(namespace_id, chunk_hashes)
        with core.lock:
            owned = [
                k
                for k in keys
                if (e := core.slots.entry(k)) and not e.ready and e.owner == session_id
            ]
        return core.abort(owned)

    def put(
        self,
        namespace_id: bytes,
        chunk_hash: bytes,
        data: Buffer,
        *,
        token_ids: bytes = b"",
        parent_hash: bytes = b"",
    ) -> str:
        """Store one chunk given inline; returns the prepare status ('reserved' = stored).
        ``token_ids`` and ``parent_hash`` describe it as in ``commit_store``."""
        ns = self._core.namespaces.get(namespace_id)
        if len(data) != ns.chunk_bytes:
            raise SizeMismatch(
                f"chunk is {len(data)} bytes; namespace {ns.namespace_id.hex()} stores chunks "
                f"of exactly {ns.chunk_bytes} bytes"
            )
        owner = f"put-{secrets.token_hex(6)}"
        (prepared,) = self.prepare_store(namespace_id, [chunk_hash], session_id=owner)
        if prepared.slot is not None:
            try:
                self._core.first.view(prepared.slot)[:] = data
            except BaseException:
                self.abort_store(namespace_id, [chunk_hash], session_id=owner)
                raise
            try:
                committed = self.commit_store(
                    namespace_id, [chunk_hash], session_id=owner, token_ids=token_ids,
                    parent_hashes=[parent_hash] if token_ids else (),
                )  # fmt: skip
            except BaseException:
                self.abort_store(namespace_id, [chunk_hash], session_id=owner)
                raise
            if not committed:
                raise ReservationExpired(
                    f"chunk {bytes(chunk_hash).hex()} was not stored: its reservation expired"
                )
        return prepared.status

    def renew_store(
        self, namespace_id: bytes, chunk_hash: bytes, owner: str, deadline: float
    ) -> bool:
        """True while ``owner`` still holds the chunk's reservation, which is then extended
        to ``deadline`` (never shortened); False once it expired or is gone. A server-side
        writer asks before each write into the slot."""
        core = self._core
        (key,) = make_chunk_keys(core.namespaces.get(namespace_id).namespace_id, [chunk_hash])
        with core.lock:
            return core.slots.renew(key, owner, deadline)

    # -- delete ----------------------------------------------------------------------------

    def delete(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> int:
        """Remove the chunks from every tier; returns how many were present anywhere."""
        core = self._core
        num = 0
        for key in core.namespaces.keys(namespace_id, chunk_hashes):
            with core.lock:
                found = core.slots.delete(key)
            num += core.lower.delete(key) or found
        return num

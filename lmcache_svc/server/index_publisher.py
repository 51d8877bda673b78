"""The server's side of the shared-memory lookup index: one table per tenant.

The cache tells the publisher each time a first-tier chunk becomes readable (commit,
promotion) or stops being readable (eviction, delete, a failed checksum), under the cache's
lock; the publisher writes the fingerprint into (or out of) the table of the chunk's tenant
(``shm.lookup_index.IndexTable``).

One writer: the publisher owns its tables, and every write to one (a chunk in or out, a
flag, the heartbeat stamp, the header of a new table, the closed mark) is made under the
publisher's lock, whichever thread makes it: a caller of ``changed`` (which holds the cache's
lock), the heartbeat thread, a session opening (``segments_for``). The sequence lock that
readers rely on (``shm.lookup_index``) needs that: two writers at once could leave the
counter even in the middle of a change, or lose a flag. Lock order: the cache's lock, then
the publisher's; the publisher never calls the cache.

A session's first event lists the tables its caller may read (``segments_for``): its own
tenant's, or every tenant's for an admin token or when authentication is off, the same
tenants whose ``Lookup`` it may call.

A tenant's table is created when its first namespace is registered or a session of its
token opens (the default tenant's at start-up), up to ``max_tenants`` tables; the chunks of
later tenants are not indexed and their clients keep using ``Lookup``.

On a CPU whose memory model the lock-free reads do not hold for (not x86-64:
``shm.lookup_index.unsupported_cpu_reason``) the server publishes no tables (``lookup_index``
returns None and logs why) and every client uses ``Lookup``.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmcache_svc.errors import ConfigError
from lmcache_svc.keys import NAMESPACE_ID_BYTES, ChunkKey, Namespace
from lmcache_svc.shm.arena import _open_new, _shm_path, _unlink_quietly
from lmcache_svc.shm.lookup_index import (
    BEAT_S,
    IndexTable,
    check_num_slots,
    segment_bytes,
    unsupported_cpu_reason,
)

if TYPE_CHECKING:
    from lmcache_svc.config import Config
    from lmcache_svc.tiers.base import Medium

log = logging.getLogger(__name__)

DEFAULT_INDEX_SLOTS = 1 << 18
"""6 MiB per tenant (24 bytes a slot); up to 196,608 chunks (``shm.lookup_index.MAX_LOAD``)
before it overflows."""
DEFAULT_MAX_TENANTS = 16
DEFAULT_TENANT = "default"
"""A namespace's tenant when it names none (``keys.Namespace``)."""


@dataclass(frozen=True, slots=True)
class IndexSegmentInfo:
    name: str
    size: int
    nonce: bytes


class IndexSegment:
    """Server side: one tenant's table in its own segment (``/dev/shm/<name>``, ``mode``)."""

    def __init__(
        self, tenant: str, tier_name: str, medium: Medium, num_slots: int, *, mode: int = 0o600
    ) -> None:
        self.name = f"lmcache-svc-index-{os.getpid()}-{secrets.token_hex(6)}"
        self.size = segment_bytes(check_num_slots(num_slots))
        path = _shm_path(self.name)
        try:
            fd = _open_new(path, mode)
        except OSError as e:
            raise ConfigError(f"cannot create index segment {path}: {e}") from e
        try:
            os.fchmod(fd, mode)
            os.ftruncate(fd, self.size)
            self._mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(fd)
            _unlink_quietly(self.name)
            raise ConfigError(f"cannot size or map index segment {path}: {e}") from e
        self._fd = fd  # holds the flock: the segment is not an orphan while we live
        self._buf = memoryview(self._mm)
        self.table = IndexTable(self._buf, num_slots, tenant, tier_name, medium)
        self.nonce = self.table.nonce

    def close(self) -> None:
        if self._fd < 0:
            return
        self.table.mark_closed()
        self.table.release()
        _unlink_quietly(self.name)
        os.close(self._fd)
        self._fd = -1
        self._buf.release()
        try:
            self._mm.close()
        except BufferError:
            pass


class IndexPublisher:
    """Thread-safe: every method takes this publisher's lock, the only lock its tables are
    written under (``changed`` is called with the cache's lock held: taken in that order)."""

    def __init__(
        self,
        tier_name: str,
        medium: Medium,
        *,
        num_slots: int = DEFAULT_INDEX_SLOTS,
        max_tenants: int = DEFAULT_MAX_TENANTS,
        mode: int = 0o600,
    ) -> None:
        self._tier_name = tier_name
        self._medium: Medium = medium
        self._num_slots = check_num_slots(num_slots)
        self._max_tenants = max_tenants
        self._mode = mode
        self._lower_tiers = False
        self._lock = threading.Lock()
        self._tenants: dict[str, IndexSegment] = {}
        self._by_namespace: dict[bytes, IndexSegment] = {}
        self._closed = False
        self._warned_full = False
        self._stop = threading.Event()
        with self._lock:
            self._table_locked(DEFAULT_TENANT)  # sessions of admins and of open servers
        self._beater = threading.Thread(target=self._beat, name="lookup-index-beat", daemon=True)
        self._beater.start()

    def _beat(self) -> None:
        """Stamp every table each ``BEAT_S``: a client stops trusting a hung server's."""
        while not self._stop.wait(BEAT_S):
            with self._lock:
                for seg in self._tenants.values():
                    seg.table.beat()

    def set_lower_tiers(self, on: bool) -> None:
        """The cache has tiers below the arena: a miss in a table is not final."""
        with self._lock:
            self._lower_tiers = on
            for seg in self._tenants.values():
                seg.table.set_lower_tiers(on)

    def add_namespace(self, namespace: Namespace) -> None:
        """Index the namespace's chunks in its tenant's table (created now if needed)."""
        with self._lock:
            if self._closed or namespace.namespace_id in self._by_namespace:
                return
            seg = self._table_locked(namespace.tenant)
            if seg is not None:
                self._by_namespace[namespace.namespace_id] = seg

    def _table_locked(self, tenant: str) -> IndexSegment | None:
        """The tenant's table, created if there is room (``max_tenants``)."""
        seg = self._tenants.get(tenant)
        if seg is not None or self._closed:
            return seg
        if len(self._tenants) >= self._max_tenants:
            if not self._warned_full:
                log.warning(
                    "lookup index: %d tenants have tables (tuning.lookup_index_tenants); "
                    "tenant %r and later ones use Lookup over gRPC",
                    self._max_tenants,
                    tenant,
                )
                self._warned_full = True
            return None
        try:
            seg = IndexSegment(
                tenant, self._tier_name, self._medium, self._num_slots, mode=self._mode
            )
        except ConfigError as e:
            log.warning("lookup index for tenant %r not created: %s", tenant, e)
            return None
        seg.table.set_lower_tiers(self._lower_tiers)
        self._tenants[tenant] = seg
        return seg

    def changed(self, key: ChunkKey, readable: bool, offset: int | None = None) -> None:
        """The chunk ``key`` became readable in the first tier (its bytes at ``offset`` of
        the sessions' arena, None when the first tier is not that arena), or stopped being
        so. Called before the chunk's slot can be freed: a load without a lease relies on it
        (``shm.lookup_index``)."""
        with self._lock:
            seg = self._by_namespace.get(key[:NAMESPACE_ID_BYTES])
            if seg is None or self._closed:
                return
            if readable:  # keyed by namespace and chunk hash (lookup_index.key_words)
                seg.table.insert(key, offset)
            else:
                seg.table.remove(key)

    def segments_for(self, tenant: str | None) -> list[IndexSegmentInfo]:
        """The tables a caller may map: ``tenant``'s (created now if needed, so a session
        opened before the tenant's first namespace is registered still gets it), or all of
        them (``None``: the default tenant's is made at start-up)."""
        with self._lock:
            if tenant is not None:
                self._table_locked(tenant)
            segs = [seg for name, seg in self._tenants.items() if tenant is None or name == tenant]
            return [IndexSegmentInfo(s.name, s.size, s.nonce) for s in segs]

    def table_of(self, tenant: str) -> IndexSegment | None:
        with self._lock:
            return self._tenants.get(tenant)

    def close(self) -> None:
        """Mark every table closed (clients stop reading it) and remove the segments."""
        self._stop.set()
        with self._lock:
            self._closed = True
            segs, self._tenants, self._by_namespace = list(self._tenants.values()), {}, {}
            for seg in segs:
                seg.close()


def lookup_index(config: Config, tier_name: str, medium: Medium) -> IndexPublisher | None:
    """The publisher the config asks for (``cpu.lookup_index``) for the first tier (its name
    and medium go into every table's header), or None: not asked for, or a CPU the index's
    lock-free reads are not safe on (logged, once: clients then use ``Lookup`` over gRPC)."""
    c = config.cpu
    if not c.lookup_index:
        return None
    reason = unsupported_cpu_reason()
    if reason is not None:
        log.warning("lookup index off (cpu.lookup_index ignored): %s; clients use Lookup", reason)
        return None
    return IndexPublisher(
        tier_name,
        medium,
        num_slots=config.tuning.lookup_index_slots,
        max_tenants=config.tuning.lookup_index_tenants,
        mode=c.shm_mode,
    )

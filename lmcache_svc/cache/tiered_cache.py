"""The tiered cache: an ordered list of tiers and the policy that moves chunks between them.

The first tier is a ``SlotTier`` (the shared-memory arena): clients write and read it in
place. Lower tiers (SSD, Redis) receive evicted chunks (demotion) or every committed chunk
(write-through), and a chunk found only in a lower tier is copied up into the first tier
when it is loaded (promotion). The cache never asks which tier is which: behaviour comes
from each tier's ``TierPolicy`` and from whether the tier is ``shared``.

Ownership is two-phase and explicit:

- store: ``prepare_store`` reserves slots (owned by a session, with a deadline; one owner
  holds at most ``max_reserved_fraction`` of the first tier), ``commit_store`` publishes
  them, ``abort_store``/session end gives them back. A reservation past its deadline is
  quarantined, never reused while its writer may still write: a late commit publishes
  nothing (it answers 0 and frees the slot), as does a late abort or the session's end;
- load: ``prepare_load`` pins the longest available prefix under a lease, ``release_load``
  (or expiry, or session end) unpins. A pinned chunk is never evicted, demoted or freed.

One lock guards the indices; bulk copies to and from lower tiers happen outside it, on
entries that are pinned or detached from the index for the duration. The cache holds the
protocol; the parts live beside it in this package and share its lock: ``chunk_index`` (the
first tier's index), ``first_tier_manager`` (slots, eviction, promotion, write-through
copies), ``lower_tier_manager`` (the lower tiers' indices and moves among them), ``sessions``
(sessions, leases, deadlines), ``background_queue`` (the write-through and checksum threads)
and ``values`` (settings and result types).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Sequence

from lmcache_svc.cache.background_queue import BackgroundQueue, Pace
from lmcache_svc.cache.chunk_index import ChunkIndex, Entry
from lmcache_svc.cache.first_tier_manager import FirstTierManager
from lmcache_svc.cache.lower_tier_manager import LowerTierManager
from lmcache_svc.cache.sessions import Sessions
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.cache.values import (
    CacheStats,
    LeasedSlots,
    LookupResult,
    PreparedStore,
    StoreStatus,
    TierPolicy,
)
from lmcache_svc.errors import (
    InvalidArgument,
    PayloadTooLarge,
    ReservationExpired,
    ReservationLimit,
    SizeMismatch,
    TooManyNamespaces,
    UnknownNamespace,
)
from lmcache_svc.index_publisher import IndexPublisher
from lmcache_svc.keys import (
    ChunkHash,
    ChunkKey,
    Namespace,
    NamespaceId,
    check_namespace_id,
    make_chunk_keys,
)
from lmcache_svc.metrics import Metrics
from lmcache_svc.tiers.base import Buffer, SegmentInfo, Slot, SlotTier, Tier

log = logging.getLogger(__name__)


class TieredCache:
    def __init__(
        self,
        first: SlotTier,
        lower: Sequence[tuple[Tier, TierPolicy]] = (),
        *,
        settings: CacheSettings | None = None,
        metrics: Metrics | None = None,
        lookup_index: IndexPublisher | None = None,
    ) -> None:
        if not isinstance(first, SlotTier):
            raise TypeError("the first tier must be a SlotTier (clients address it in place)")
        self.settings = settings or CacheSettings()
        self.metrics = metrics or Metrics()
        self._first = first
        self._lower = LowerTierManager(lower, self.metrics)
        self._lock = threading.RLock()
        self._index = ChunkIndex(first.slot_of, self._lock)
        self.lookup_index = lookup_index
        if lookup_index is not None:  # published chunks: see index_publisher.py
            self._index.on_change = lookup_index.changed
            lookup_index.set_lower_tiers(bool(lower))
        self._first_tier = FirstTierManager(
            first,
            self._index,
            self._lower,
            self._lock,
            self.metrics,
            checksums=self.settings.checksums,
        )
        self._namespaces: dict[NamespaceId, Namespace] = {}
        self._sessions = Sessions(
            self._lock,
            self._index,
            self.settings,
            self.metrics,
            unpin=self._first_tier.unpin,
            abort=self._abort_keys,
        )
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._maintenance: threading.Thread | None = None
        self._write_through = BackgroundQueue(
            self._first_tier.copy_through, enabled=self._lower.has_write_through
        )
        self._checksummer = BackgroundQueue(
            self._first_tier.record_checksums, enabled=self.settings.checksums, name="checksums",
            pace=Pace(self.settings.checksum_quiet_s, self.settings.checksum_max_delay_s),
            max_batch=8,  # paced between batches: a short one, so stores wait for little
        )  # fmt: skip
        self._media = {t.name: t.medium for t in self.tiers}
        self.metrics.watch_tiers(lambda: [t.stats() for t in self.tiers])

    @property
    def tiers(self) -> list[Tier]:
        return [self._first, *self._lower.tiers]

    def segment(self) -> SegmentInfo:
        return self._first.segment()

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start background maintenance (expiry, watermark eviction) and write-through."""
        self._maintenance = threading.Thread(
            target=self._maintain, name="lmcache-svc-maintenance", daemon=True
        )
        self._maintenance.start()
        self._write_through.start()
        self._checksummer.start()

    def close(self) -> None:
        """Stop background work, finish queued write-throughs, close every tier."""
        self._stop.set()
        self._wake.set()
        if self._maintenance is not None:
            self._maintenance.join(timeout=10)
        self._write_through.stop()
        self._checksummer.stop()
        if self.lookup_index is not None:
            with self._lock:
                self.lookup_index.close()
        self._first.close()
        self._lower.close()

    def _maintain(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.settings.maintenance_interval_s)
            self._wake.clear()
            try:
                self.reap_expired()
                self.evict_to_watermark()
                self._lower.probe_down_tiers()
            except Exception:  # keep the thread alive; the error is logged and counted
                log.exception("maintenance step failed")
                self.metrics.errors.labels(kind="maintenance").inc()

    # -- namespaces and sessions ---------------------------------------------------------

    def register_namespace(self, namespace: Namespace) -> Namespace:
        """Register (or find again) a namespace; ``TooManyNamespaces`` past the limit."""
        limit = self.settings.max_chunk_bytes
        if namespace.chunk_bytes > limit:
            raise InvalidArgument(
                f"namespace chunk_bytes is {namespace.chunk_bytes}, over this server's "
                f"max_body_bytes ({limit}): use a smaller chunk_size"
            )
        with self._lock:
            known = self._namespaces.get(namespace.namespace_id)
            if known is not None:
                return known
            if len(self._namespaces) >= self.settings.max_namespaces:
                raise TooManyNamespaces(
                    f"this server holds {len(self._namespaces)} namespaces, its limit "
                    "(cache.max_namespaces); registered ones keep working"
                )
            self._namespaces[namespace.namespace_id] = namespace
            if self.lookup_index is not None:
                self.lookup_index.add_namespace(namespace)
            return namespace

    def namespace(self, namespace_id: bytes) -> Namespace:
        ns_id = check_namespace_id(namespace_id)
        try:
            return self._namespaces[ns_id]
        except KeyError:
            raise UnknownNamespace(
                f"namespace {ns_id.hex()} is not registered; register it first"
            ) from None

    def open_session(self) -> str:
        return self._sessions.open_session()

    def has_session(self, session_id: str) -> bool:
        return self._sessions.has_session(session_id)

    def close_session(self, session_id: str) -> None:
        """The client is gone: give back its reservations and leases now."""
        self._sessions.close_session(session_id)

    def check_batch(self, namespace_id: bytes, num_chunks: int) -> Namespace:
        """The registered namespace of a request for ``num_chunks`` chunks, once that count
        is within ``max_chunks_per_request`` (``PayloadTooLarge`` otherwise)."""
        if num_chunks > self.settings.max_chunks_per_request:
            raise PayloadTooLarge(
                f"{num_chunks} chunks in one request; the limit is "
                f"{self.settings.max_chunks_per_request}"
            )
        return self.namespace(namespace_id)

    def _keys(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> list[ChunkKey]:
        ns = self.check_batch(namespace_id, len(chunk_hashes))
        return make_chunk_keys(ns.namespace_id, chunk_hashes)

    # -- lookup ----------------------------------------------------------------------------

    def lookup(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> LookupResult:
        """Longest contiguous prefix of the chunks present in any tier, and where each is."""
        keys = self._keys(namespace_id, chunk_hashes)
        tiers = self._locate_local(keys)
        rest = keys[len(tiers) :]
        if rest:
            tiers += [lt.tier.name for lt in self._lower.sources(rest)]
        return self._counted_lookup(keys, tiers)

    def lookup_local(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes]
    ) -> LookupResult | None:
        """``lookup``'s answer when the in-memory indices give all of it, else ``None`` (a
        shared tier that is not marked down would have to be asked). Never blocks on a
        lower tier."""
        keys = self._keys(namespace_id, chunk_hashes)
        tiers = self._locate_local(keys)
        if len(tiers) < len(keys) and self._lower.shared_in_use:
            return None
        return self._counted_lookup(keys, tiers)

    def first_tier_holds(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> bool:
        """Whether every chunk is readable in the first tier now (a load needs no lower tier)."""
        keys = self._keys(namespace_id, chunk_hashes)
        with self._lock:
            return all(self._index.readable(key) for key in keys)

    def _counted_lookup(self, keys: list[ChunkKey], tiers: list[str]) -> LookupResult:
        self.metrics.lookup_chunks.inc(len(keys))
        self.metrics.lookup_hit_chunks.inc(len(tiers))
        self.metrics.misses.inc(len(keys) - len(tiers))
        for name, num in Counter(tiers).items():
            self.metrics.hits.labels(tier=name).inc(num)
        return LookupResult(len(tiers), tiers, [self._media[name] for name in tiers])

    def _locate_local(self, keys: list[ChunkKey]) -> list[str]:
        """Where each chunk of the longest prefix known to the in-memory indices is."""
        found: list[str] = []
        with self._lock:
            for key in keys:
                if self._index.readable(key):
                    found.append(self._first.name)
                    continue
                tier = self._lower.local_tier(key)
                if tier is None:
                    break
                found.append(tier.name)
        return found

    # -- store -----------------------------------------------------------------------------

    def prepare_store(
        self,
        namespace_id: bytes,
        chunk_hashes: Sequence[bytes],
        *,
        session_id: str | None = None,
        ttl_s: float | None = None,
    ) -> list[PreparedStore]:
        keys = self._keys(namespace_id, chunk_hashes)
        nbytes = self.namespace(namespace_id).chunk_bytes
        s = self.settings
        deadline = self._sessions.deadline(ttl_s, s.reservation_ttl_s, s.max_reservation_ttl_s)
        self._check_reservation_limit(session_id, len(keys), nbytes)
        out: list[PreparedStore] = []
        for key, h in zip(keys, chunk_hashes):
            status, slot = self._reserve(key, nbytes, session_id, deadline)
            out.append(PreparedStore(ChunkHash(bytes(h)), status, slot))
        self._update_pending()
        return out

    def _check_reservation_limit(self, owner: str | None, num: int, chunk_bytes: int) -> None:
        """An owner holds at most its share of the first tier reserved (one chunk always)."""
        limit = int(self.settings.max_reserved_fraction * self._first.capacity_bytes)
        nbytes = num * chunk_bytes
        with self._lock:
            held = self._index.owned_bytes(owner)
        if held + nbytes > max(limit, chunk_bytes):
            who = f"session {owner!r}" if owner else "session-less callers"
            raise ReservationLimit(
                f"{who} would hold {held + nbytes} bytes reserved (expired reservations not "
                f"yet committed or aborted included); the limit is {limit} bytes "
                f"(cache.max_reserved_fraction of the first tier): commit or abort first"
            )

    def _reserve(
        self, key: ChunkKey, nbytes: int, owner: str | None, deadline: float
    ) -> tuple[StoreStatus, Slot | None]:
        with self._lock:
            if self._index.readable(key):
                self._index.touch(key)
                return "already_stored", None
            if self._index.busy(key):  # reserved, promoting, deleted while pinned, demoting
                return "in_progress", None
            if self._lower.local_tier(key) is not None:
                return "already_stored", None
        slot = self._first_tier.allocate(key, nbytes, owner, deadline)
        return ("reserved", slot) if slot is not None else ("no_space", None)

    def commit_store(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], *, session_id: str | None = None
    ) -> int:
        return self._commit_keys(self._keys(namespace_id, chunk_hashes), session_id)

    def bind_store(
        self,
        namespace_id: bytes,
        chunk_hashes: Sequence[bytes],
        reserved_as: Sequence[bytes],
        *,
        session_id: str | None = None,
    ) -> tuple[int, list[bytes]]:
        """Commit pooled reservations under the chunks written into them: the slot reserved
        for placeholder ``reserved_as[i]`` becomes chunk ``chunk_hashes[i]``. Returns (chunks
        committed, placeholders still reserved): a placeholder whose chunk is stored or being
        stored already stays its owner's, to be written again; one that is not the caller's
        live reservation (expired, aborted, another session's) publishes nothing."""
        if len(reserved_as) != len(chunk_hashes):
            raise InvalidArgument(
                f"{len(chunk_hashes)} chunk hashes but {len(reserved_as)} reserved_as hashes"
            )
        keys = self._keys(namespace_id, chunk_hashes)
        placeholders = self._keys(namespace_id, reserved_as)
        bound: list[ChunkKey] = []
        kept: list[bytes] = []
        with self._lock:
            for key, placeholder, raw in zip(keys, placeholders, reserved_as):
                if self._live_reservation(placeholder, session_id) is None:
                    continue
                if self._index.busy(key) or self._lower.local_tier(key) is not None:
                    kept.append(bytes(raw))
                    continue
                self._first_tier.rekey(placeholder, key)
                bound.append(key)
            # under the same hold: the reaper cannot expire a rekeyed reservation before
            # its commit (it would stay quarantined under the chunk's own key)
            return self._commit_keys(bound, session_id), kept

    def _live_reservation(self, key: ChunkKey, owner: str | None) -> Entry | None:
        """``owner``'s reservation of ``key`` while it may still be committed; one past its
        deadline is freed (its slot may have been rewritten) and None returned. Lock held."""
        entry = self._index.entry(key)
        if entry is None or entry.ready or entry.doomed or entry.owner != owner:
            return None
        if entry.expired or entry.deadline <= time.monotonic():
            if entry.pins == 0:
                self._first_tier.free(key)
            return None
        return entry

    def _commit_keys(self, keys: Sequence[ChunkKey], session_id: str | None) -> int:
        committed: list[ChunkKey] = []
        with self._lock:
            for key in keys:
                entry = self._live_reservation(key, session_id)
                if entry is None:
                    continue
                self._index.mark_ready(key, entry)
                self._index.touch(key)
                self.metrics.bytes_written.labels(tier=self._first.name).inc(entry.slot.length)
                committed.append(key)
        self._update_pending()
        self._checksummer.submit(committed)
        self._write_through.submit(committed)
        self._wake_if_above_watermark()
        return len(committed)

    def abort_store(
        self, namespace_id: bytes, chunk_hashes: Sequence[bytes], *, session_id: str | None = None
    ) -> int:
        keys = self._keys(namespace_id, chunk_hashes)
        with self._lock:
            owned = [
                k
                for k in keys
                if (e := self._index.entry(k)) and not e.ready and e.owner == session_id
            ]
        return self._abort_keys(owned)

    def _abort_keys(self, keys: Sequence[ChunkKey]) -> int:
        num = 0
        with self._lock:
            for key in keys:
                entry = self._index.entry(key)
                if entry is not None and not entry.ready and entry.pins == 0:
                    self._first_tier.free(key)
                    num += 1
        self._update_pending()
        return num

    def put(self, namespace_id: bytes, chunk_hash: bytes, data: Buffer) -> str:
        """Store one chunk given inline; returns the prepare status ('reserved' = stored)."""
        ns = self.namespace(namespace_id)
        if len(data) != ns.chunk_bytes:
            raise SizeMismatch(
                f"chunk is {len(data)} bytes; namespace {ns.namespace_id.hex()} stores chunks "
                f"of exactly {ns.chunk_bytes} bytes"
            )
        owner = f"put-{secrets.token_hex(6)}"
        (prepared,) = self.prepare_store(namespace_id, [chunk_hash], session_id=owner)
        if prepared.slot is not None:
            try:
                self._first.view(prepared.slot)[:] = data
            except BaseException:
                self.abort_store(namespace_id, [chunk_hash], session_id=owner)
                raise
            if not self.commit_store(namespace_id, [chunk_hash], session_id=owner):
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
        (key,) = make_chunk_keys(self.namespace(namespace_id).namespace_id, [chunk_hash])
        now = time.monotonic()
        with self._lock:
            entry = self._index.entry(key)
            if entry is None or entry.ready or entry.owner != owner or entry.expired:
                return False
            if entry.deadline <= now:
                return False
            self._index.extend_deadline(key, deadline)
            return True

    # -- load ------------------------------------------------------------------------------

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
        keys = self._keys(namespace_id, chunk_hashes)
        nbytes = self.namespace(namespace_id).chunk_bytes
        # Checked before anything is pinned: a bad ttl must not leave pins behind.
        s = self.settings
        deadline = self._sessions.deadline(ttl_s, s.lease_ttl_s, s.max_lease_ttl_s)
        pinned: list[ChunkKey] = []
        sources: list[str] = []
        with self._lock:
            for key in keys:
                if not self._index.readable(key):
                    break
                self._index.pin(key)
                self._index.touch(key)
                pinned.append(key)
                sources.append(self._first.name)
        if len(pinned) < len(keys):
            promoted, promoted_from = self._first_tier.promote(keys[len(pinned) :], nbytes)
            self._checksummer.submit(promoted)
            pinned += promoted
            sources += promoted_from
        if verify:
            pinned, sources = self._verified(pinned, sources)
        if not pinned:
            return LeasedSlots(None)
        with self._lock:
            lease_id = self._sessions.grant(pinned, session_id, deadline)
            slots = [self._index.slot_of(k) for k in pinned]
        for slot, name in zip(slots, sources):
            self.metrics.bytes_read.labels(tier=name).inc(slot.length)
        return LeasedSlots(lease_id, slots, sources)

    def _verified(
        self, pinned: list[ChunkKey], sources: list[str]
    ) -> tuple[list[ChunkKey], list[str]]:
        """The intact prefix of pinned chunks; the rest are unpinned (a corrupted one is
        dropped, so a later load may promote a good copy from a lower tier)."""
        num = self._first_tier.verified_prefix(pinned)
        with self._lock:
            for key in pinned[num:]:
                self._first_tier.unpin(key)
        return pinned[:num], sources[:num]

    def release_load(self, lease_id: str) -> bool:
        return self._sessions.release(lease_id)

    def get(
        self, namespace_id: bytes, chunk_hash: bytes, *, verify: bool = False
    ) -> tuple[bytes, str] | None:
        """One chunk's bytes and the tier it was found in, or None (with ``verify``, also
        when its bytes differ from its checksum: the chunk is then dropped)."""
        lease = self.prepare_load(namespace_id, [chunk_hash], verify=verify)
        if lease.lease_id is None:
            return None
        try:
            return bytes(self._first.view(lease.slots[0])), lease.source_tiers[0]
        finally:
            self.release_load(lease.lease_id)

    def contains(self, namespace_id: bytes, chunk_hash: bytes) -> str | None:
        """Name of the tier holding the chunk, or None."""
        result = self.lookup(namespace_id, [chunk_hash])
        return result.tiers[0] if result.num_hit_chunks else None

    def view(self, slot: Slot) -> memoryview:
        return self._first.view(slot)

    # -- delete ----------------------------------------------------------------------------

    def delete(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> int:
        """Remove the chunks from every tier; returns how many were present anywhere."""
        num = 0
        for key in self._keys(namespace_id, chunk_hashes):
            found = False
            with self._lock:
                if self._index.readable(key):
                    found = True
                    entry = self._index.entry(key)
                    if entry is not None and entry.pins:
                        self._index.doom(key)
                    else:
                        self._first_tier.free(key)
            num += self._lower.delete(key) or found
        return num

    # -- eviction and demotion -------------------------------------------------------------

    def evict_to_watermark(self) -> int:
        """Evict from the first tier until it is under the low watermark; returns chunks."""
        first = self._first
        if first.used_bytes <= self.settings.high_watermark * first.capacity_bytes:
            return 0
        target = first.used_bytes - int(self.settings.low_watermark * first.capacity_bytes)
        return self._first_tier.evict(target)

    def _wake_if_above_watermark(self) -> None:
        if self._first.used_bytes > self.settings.high_watermark * self._first.capacity_bytes:
            self._wake.set()

    # -- write-through ---------------------------------------------------------------------

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write-through copy and checksum is done; False on timeout."""
        return self._checksummer.flush(timeout_s) and self._write_through.flush(timeout_s)

    # -- expiry ----------------------------------------------------------------------------

    def reap_expired(self, now: float | None = None) -> int:
        """Release leases past their deadline and quarantine such reservations; returns
        how many."""
        num = self._sessions.reap_expired(now)
        self._update_pending()
        return num

    # -- helpers ---------------------------------------------------------------------------

    def _update_pending(self) -> None:
        with self._lock:
            num_pending, quarantined = self._index.num_pending, self._index.quarantined_bytes
        self.metrics.pending_stores.set(num_pending)
        self.metrics.quarantined_bytes.set(quarantined)

    def num_pending_stores(self) -> int:
        with self._lock:
            return self._index.num_pending

    def stats(self) -> CacheStats:
        with self._lock:
            num_leases, num_ns = self._sessions.num_leases, len(self._namespaces)
        return CacheStats(
            tiers=[t.stats() for t in self.tiers],
            active_leases=num_leases,
            pending_stores=self.num_pending_stores(),
            num_namespaces=num_ns,
        )

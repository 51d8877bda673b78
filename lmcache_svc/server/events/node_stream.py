"""The node-level event stream: what this server's tiers hold, in vLLM's event format.

The cache tells ``NodeEvents`` (its ``ChunkListener``) when a chunk becomes loadable in a
tier and when it stops being so; ``NodeEvents`` keeps, per tier, the set of chunks it has
announced, so a store is announced once per tier, a removal only after its store, and a
chunk is announced only with its token ids (``meta.py``) and after its parent (or as a
sequence's first chunk): a chunk whose parent is in no tier cannot be part of any prefix a
load would find, and is not announced.

Identity in the event (vLLM's fields):

- ``medium``: ``CPU`` for the arena, ``STORAGE`` for SSD and Redis (a device tier is not
  published); ``locality``: ``REMOTE`` for a shared tier (Redis), else ``LOCAL``.
- ``block_size``: the namespace's engine block size; a chunk is ``chunk_size /
  block_size`` blocks, whose hashes are this server's own: block ``j`` of a chunk is the
  first 8 bytes of the chunk hash (big-endian) plus ``j``, modulo 2**64. Engines use other
  hashes: the vLLM plugin re-announces each chunk with its engine's own
  (``connectors/vllm/lmcache_svc_vllm/events.py``).
- topic: ``events.topic`` with ``{node}``, ``{model}``, ``{tenant}``, ``{namespace}``
  filled in; only tensor-parallel rank 0's namespaces are published (rank 0's chunks stand
  for the engine's), and, when ``events.tenants`` is set, only those tenants'.

The store path pays little: ``chunk_changed`` (called by the cache, under its locks) appends a
record ``(tier, view, published, key, loadable)`` to the log's ``changes`` and takes this
stream's lock only to wake an idle publisher thread; that thread applies the records in
order (``_apply``: the per-tier sets, the checks above, the event's recipe) before it
numbers the batch, and builds the events (``_stored``: block hashes, token ids encoded as
msgpack from the packed tokens) when it encodes them. Whatever reads the sets (snapshots,
resyncs, ``tier_contents``, a new subscriber) applies the pending records first, so the
order of stores and removals per chunk, and what is announced, are those of the calls. A
publisher that falls ``max_pending`` records behind makes each caller apply
``HELP_PER_RECORD`` of them per record it adds (``publisher.py``).

Chunks a lower tier held at start-up (an SSD tier's files after a restart, a shared Redis
other servers wrote to) or a resync found are announced from the descriptions stored with
their values (``chunks_found``): each is checked against its chunk hash as a received one
is, waits in ``found.FoundChunks`` until its namespace is registered (and its tier is up),
and is announced then, parents first.

The first time a topic is used after start-up its stream begins with ``AllBlocksCleared``
(a restarted server announces that what it published before is gone); the same happens,
followed by a full re-announcement, when the pending queue overflowed (events dropped): the
publisher builds that resync once, on its own thread, from what is announced when it
catches up (``_resync_locked``), so no removal is lost with the dropped queue. It is built
under this stream's lock, which callers take under the cache's only to wake the publisher,
to read the sets or when the publisher is behind: such a caller waits while it is built
(once per overflow, in time proportional to what is announced).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from lmcache_svc.errors import InvalidArgument
from lmcache_svc.keys import NAMESPACE_ID_BYTES, ChunkKey, Namespace, NamespaceId
from lmcache_svc.server.events.format import (
    HASH_MASK,
    AllBlocksCleared,
    BlockRemoved,
    Locality,
    Medium,
    Pending,
    StoredWire,
    token_ids_raw,
)
from lmcache_svc.server.events.found import FoundChunks, hashes_to
from lmcache_svc.server.events.meta import ChunkMeta, MetaStore, describe_chunks, parent_key
from lmcache_svc.server.events.metrics import EventMetrics
from lmcache_svc.server.events.publisher import EventLog, ZmqPublisher
from lmcache_svc.server.events.settings import EventsSettings
from lmcache_svc.tiers.base import ChunkDescription, Tier

if TYPE_CHECKING:
    from lmcache_svc.server.events.redis_channel import RedisChannel

log = logging.getLogger(__name__)

SNAPSHOT_BATCH = 512
"""Events per batch of a snapshot answer."""
HELP_PER_RECORD = 2
"""Records a caller applies per record it adds while the publisher is ``max_pending``
records behind."""


@dataclass(frozen=True, slots=True)
class TierView:
    medium: Medium
    locality: Locality


def tier_view(tier: Tier) -> TierView | None:
    """How a tier's chunks are announced (None: not published)."""
    locality: Locality = "REMOTE" if tier.shared else "LOCAL"
    if tier.medium == "host_memory":
        return TierView("CPU", locality)
    if tier.medium in ("disk", "remote"):
        return TierView("STORAGE", locality)
    return None


@dataclass(frozen=True, slots=True)
class Published:
    topic: bytes
    block_size: int
    blocks_per_chunk: int
    namespace: Namespace


Change = tuple[str, TierView, Published, ChunkKey, bool]
"""A chunk became loadable (True) or stopped being so in a tier: tier name, its view, the
namespace's publication, the key."""


def block_hashes(chunk_hash: bytes, num_blocks: int) -> list[int]:
    """This server's hashes of a chunk's blocks."""
    base = int.from_bytes(chunk_hash[:8], "big")
    if base + num_blocks <= HASH_MASK + 1:  # no wrap (all but 1 in 2**64 / num_blocks)
        return list(range(base, base + num_blocks))
    return [(base + j) & HASH_MASK for j in range(num_blocks)]


def last_block_hash(chunk_hash: bytes, num_blocks: int) -> int:
    """``block_hashes(chunk_hash, num_blocks)[-1]``."""
    return (int.from_bytes(chunk_hash[:8], "big") + num_blocks - 1) & HASH_MASK


class NodeEvents:
    """The cache's ``ChunkListener`` that publishes the node-level stream."""

    def __init__(self, settings: EventsSettings, metrics: EventMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self._lock = threading.Lock()
        self._meta = MetaStore(settings.max_chunks)
        self._published: dict[NamespaceId, Published] = {}
        self._topics: dict[bytes, NamespaceId] = {}
        self._views: dict[str, TierView | None] = {}
        self._announced: dict[str, set[ChunkKey]] = {}
        self._found = FoundChunks()
        self._log: EventLog[Change] = EventLog(
            settings.buffer_steps, settings.max_pending, self._resync_locked, self._apply
        )
        self._channel: RedisChannel | None = None
        self.publisher = ZmqPublisher(
            settings.endpoint,
            settings.replay_endpoint,
            lock=self._lock,
            log_=self._log,
            snapshot=self.snapshot,
            hwm=settings.hwm,
            on_sent=metrics.batches.inc,
            on_lost=metrics.dropped_batches.inc,
            on_subscribed=self._subscribed,
        )

    # -- the ChunkListener interface -------------------------------------------------------

    def namespace_registered(self, namespace: Namespace) -> None:
        s = self.settings
        if namespace.tp_rank != 0 or (s.tenants is not None and namespace.tenant not in s.tenants):
            return
        topic = s.topic_for(namespace).encode()
        block_size = namespace.layout.block_size
        with self._lock:
            if namespace.namespace_id in self._published:
                return
            other = self._topics.get(topic)
            if other is not None:
                log.error(
                    "events: namespace %s maps to topic %r, already used by namespace %s; "
                    "not published (put {namespace} in events.topic)",
                    namespace.namespace_id.hex(), topic.decode(), other.hex(),
                )  # fmt: skip
                return
            self._topics[topic] = namespace.namespace_id
            self._published[namespace.namespace_id] = Published(
                topic, block_size, max(1, namespace.chunk_size // block_size), namespace
            )
            self._queue(topic, [AllBlocksCleared()])
            woken = self._wake_found_locked(namespace.namespace_id)
        for change in woken:
            self._record(change)

    def _subscribed(self) -> None:
        """A subscriber (re)connected: every topic on which nothing is announced yet starts
        again with ``AllBlocksCleared`` (harmless to anyone: there is nothing to clear), so a
        router that reconnects to a restarted server hears of the restart, even if it missed
        the first one."""
        with self._lock:
            self._log.apply_changes()
            held = {self._topic_of_key(k) for keys in self._announced.values() for k in keys}
            for topic in self._topics:
                if topic not in held:
                    self._queue(topic, [AllBlocksCleared()])

    def topic_of(self, namespace_id: bytes) -> str | None:
        pub = self._published.get(NamespaceId(bytes(namespace_id)))
        return None if pub is None else pub.topic.decode()

    def chunk_described(self, key: ChunkKey, meta: ChunkMeta) -> None:
        if key[:NAMESPACE_ID_BYTES] in self._published:
            self._meta.put(key, meta)

    def chunk_changed(self, tier: Tier, key: ChunkKey, loadable: bool) -> None:
        view = self._view(tier)
        pub = self._published.get(NamespaceId(key[:NAMESPACE_ID_BYTES]))
        if view is None or pub is None:
            if not loadable and self._found:
                with self._lock:
                    self._found.forget(tier, key)
            return
        if tier.shared and self._channel is not None:  # tell the other servers
            self._channel.announce(key, self._meta.get(key), loadable)
        self._record((tier.name, view, pub, key, loadable))

    def attach_channel(self, channel: RedisChannel) -> None:
        self._channel = channel

    def remote_changed(self, tier: Tier, key: ChunkKey, meta: ChunkMeta | None) -> bool:
        """Another server wrote ``key`` to the shared ``tier`` (described by ``meta``) or
        removed it (``None``); False when the description does not match the key."""
        view = self._view(tier)
        pub = self._published.get(NamespaceId(key[:NAMESPACE_ID_BYTES]))
        if view is None or pub is None:
            return True  # not a namespace this server publishes
        if meta is not None:
            try:
                (checked,) = describe_chunks(
                    pub.namespace, [key[NAMESPACE_ID_BYTES:]], meta.tokens,
                    [b"" if meta.parent == pub.namespace.namespace_id else meta.parent],
                )  # fmt: skip
            except InvalidArgument:
                return False
            self._meta.put(key, checked)
        self._record((tier.name, view, pub, key, meta is not None))
        return True

    # -- chunks found in a tier at start-up or by a resync --------------------------------

    @property
    def max_described(self) -> int:
        return self.settings.max_chunks

    def description(self, key: ChunkKey) -> ChunkDescription | None:
        """The chunk's description, for a tier to store with its value."""
        return self._meta.get(key)

    def chunks_found(self, tier: Tier, found: Sequence[tuple[ChunkKey, ChunkDescription]]) -> None:
        """``tier`` holds these chunks, described so (read from their values): each is
        checked against its hash; those of a published namespace are announced, the others
        kept until their namespace is registered."""
        if self._view(tier) is None:
            return
        checked: list[tuple[ChunkKey, ChunkDescription]] = []
        for key, desc in found:  # one sha256 each, outside the lock
            if hashes_to(key, desc):
                checked.append((key, desc))
            else:
                self._refuse(tier, key, "its token ids and parent do not hash to it")
        with self._lock:
            self._found.add(tier, checked)
            changes = [] if self._found.is_down(tier) else self._wake_found_locked(None, tier)
        for change in changes:
            self._record(change)

    def _wake_found_locked(
        self, namespace_id: NamespaceId | None, tier: Tier | None = None
    ) -> list[Change]:
        """The changes that announce the found chunks of published namespaces (of
        ``namespace_id`` only, or of ``tier`` only, when given), parents first; each
        description's token count is checked against the namespace's chunk size (its hash
        was checked when it was found)."""

        def wanted(key: ChunkKey) -> bool:
            ns_id = key[:NAMESPACE_ID_BYTES]
            return namespace_id in (None, ns_id) and ns_id in self._published

        woken: list[tuple[ChunkKey, Tier]] = []
        for key, held_by, desc in self._found.take(wanted, tier):
            chunk_size = self._published[NamespaceId(key[:NAMESPACE_ID_BYTES])].namespace.chunk_size
            if len(desc.tokens) != 4 * chunk_size:
                why = f"its description holds {len(desc.tokens) // 4} token ids, its "
                self._refuse(held_by, key, why + f"namespace's chunks {chunk_size}")
                continue
            self._meta.put(key, desc)
            woken.append((key, held_by))
        depth = self._depths([k for k, _ in woken])
        woken.sort(key=lambda item: depth[item[0]])
        out: list[Change] = []
        for key, held_by in woken:
            view = self._view(held_by)
            pub = self._published[NamespaceId(key[:NAMESPACE_ID_BYTES])]
            if view is not None:
                out.append((held_by.name, view, pub, key, True))
        return out

    def _refuse(self, tier: Tier, key: ChunkKey, why: str) -> None:
        log.warning(
            "events: chunk %s found in tier %s not announced: %s", key.hex(), tier.name, why
        )
        self.metrics.unannounced.labels(reason="bad_description").inc()

    def _record(self, change: Change) -> None:
        """Queue a change for the publisher's thread; wake it if it waits (``idle``), help
        it if it is behind."""
        changes = self._log.changes
        changes.append(change)
        if len(changes) > self._log.max_pending:
            with self._lock:
                self._log.apply_changes(HELP_PER_RECORD)
        if self.publisher.idle:
            with self._lock:
                self.publisher.wake()

    def _apply(self, change: Change) -> None:
        """A change's effect on the announced sets and the events (lock held)."""
        tier_name, view, pub, key, loadable = change
        announced = self._announced.setdefault(tier_name, set())
        if not loadable:
            if key in announced:
                announced.discard(key)
                self._queue(pub.topic, [partial(_removed, key, pub, view)])
            return
        if key in announced:
            return
        event = self._stored_locked(key, pub, view)
        if event is not None:
            announced.add(key)
            self._queue(pub.topic, [event])

    def tier_contents(self, tier: Tier, keys: Iterable[ChunkKey] | None) -> None:
        """The tier now holds exactly ``keys`` (a resync), or nothing loadable (``None``:
        marked down)."""
        view = self._view(tier)
        if view is None:
            return
        held = set(keys) if keys is not None else set()
        with self._lock:
            self._log.apply_changes()
            if keys is None:
                self._found.tier_down(tier)
            else:  # found chunks of published namespaces get their metadata: announced below
                self._found.tier_holds(tier, held)
                self._wake_found_locked(None, tier)
            announced = self._announced.setdefault(tier.name, set())
            for key in [k for k in announced if k not in held]:
                announced.discard(key)
                pub = self._published.get(NamespaceId(key[:NAMESPACE_ID_BYTES]))
                if pub is not None:
                    self._queue(pub.topic, [partial(_removed, key, pub, view)])
            for key in self._parents_first(k for k in held if k not in announced):
                pub = self._published.get(NamespaceId(key[:NAMESPACE_ID_BYTES]))
                event = None if pub is None else self._stored_locked(key, pub, view)
                if pub is not None and event is not None:
                    announced.add(key)
                    self._queue(pub.topic, [event])

    # -- snapshots -------------------------------------------------------------------------

    def snapshot(self, topic: bytes) -> tuple[int, list[list[Pending]]]:
        """Every chunk announced on ``topic`` now, parents first, in batches; and the
        sequence of the last batch this covers."""
        with self._lock:
            seq = self._log.flush()
            events = self._announcement_locked(topic)
        return seq, [events[i : i + SNAPSHOT_BATCH] for i in range(0, len(events), SNAPSHOT_BATCH)]

    def _announcement_locked(self, topic: bytes | None) -> list[Pending]:
        """Stores for every chunk announced (on ``topic``, or all), parents first."""
        pairs: list[tuple[ChunkKey, str]] = []
        for name, keys in self._announced.items():
            pairs += [(k, name) for k in keys if topic is None or self._topic_of_key(k) == topic]
        depth = self._depths([k for k, _ in pairs])
        pairs.sort(key=lambda p: depth[p[0]])
        out: list[Pending] = []
        for key, name in pairs:
            view = self._views.get(name)
            pub = self._published.get(NamespaceId(key[:NAMESPACE_ID_BYTES]))
            meta = self._meta.get(key)
            if view is not None and pub is not None and meta is not None:
                out.append(_stored(key, meta, pub, view))
        return out

    def _topic_of_key(self, key: ChunkKey) -> bytes | None:
        pub = self._published.get(NamespaceId(key[:NAMESPACE_ID_BYTES]))
        return None if pub is None else pub.topic

    def _depths(self, keys: list[ChunkKey]) -> dict[ChunkKey, int]:
        depth: dict[ChunkKey, int] = {}
        for key in keys:
            chain: list[ChunkKey] = []
            k: ChunkKey | None = key
            while k is not None and k not in depth:
                chain.append(k)
                meta = self._meta.get(k)
                k = None if meta is None else parent_key(k, meta)
                if len(chain) > 1_000_000:  # a cycle cannot happen (hashes); be safe
                    break
            base = depth[k] + 1 if k is not None and k in depth else 0
            for i, c in enumerate(reversed(chain)):
                depth[c] = base + i
        return depth

    def _parents_first(self, keys: Iterable[ChunkKey]) -> list[ChunkKey]:
        todo = list(keys)
        depth = self._depths(todo)
        return sorted(todo, key=depth.__getitem__)

    # -- helpers ---------------------------------------------------------------------------

    def _view(self, tier: Tier) -> TierView | None:
        try:
            return self._views[tier.name]
        except KeyError:
            view = self._views[tier.name] = tier_view(tier)
            return view

    def _stored_locked(self, key: ChunkKey, pub: Published, view: TierView) -> Pending | None:
        meta = self._meta.get(key)
        if meta is None:
            self.metrics.unannounced.labels(reason="no_tokens").inc()
            return None
        parent = parent_key(key, meta)
        if parent is not None and not any(parent in s for s in self._announced.values()):
            self.metrics.unannounced.labels(reason="no_parent").inc()
            return None
        return partial(_stored, key, meta, pub, view)  # built on the publisher's thread

    def _queue(self, topic: bytes, events: list[Pending]) -> None:
        """Queue events (lock held); on overflow the queue is dropped and a resync due."""
        due = self._log.resync_due
        dropped = self._log.add(topic, events)
        if dropped:
            self.metrics.dropped_events.inc(dropped)
        if dropped and not due:
            log.warning("events: %d events dropped (queue full); resyncing subscribers", dropped)
            self.metrics.resyncs.inc()
        if self.publisher.idle:
            self.publisher.wake()

    def _resync_locked(self) -> dict[bytes, list[Pending]]:
        """What replaces a dropped queue: per topic, a clear and every chunk announced now
        (built on the publisher's thread when it flushes, lock held)."""
        return {t: [AllBlocksCleared(), *self._announcement_locked(t)] for t in self._topics}

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self.publisher.close()


def _stored(key: ChunkKey, meta: ChunkMeta, pub: Published, view: TierView) -> StoredWire:
    """The chunk's ``BlockStored`` (its token ids encoded once, as msgpack)."""
    n = pub.blocks_per_chunk
    first = meta.parent == key[:NAMESPACE_ID_BYTES]
    return StoredWire(
        block_hashes=block_hashes(key[NAMESPACE_ID_BYTES:], n),
        parent_block_hash=None if first else last_block_hash(meta.parent, n),
        token_ids=token_ids_raw(meta.tokens),
        block_size=pub.block_size,
        lora_id=None,
        medium=view.medium,
        lora_name=None,
        locality=view.locality,
    )


def _removed(key: ChunkKey, pub: Published, view: TierView) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=block_hashes(key[NAMESPACE_ID_BYTES:], pub.blocks_per_chunk),
        medium=view.medium,
        locality=view.locality,
    )

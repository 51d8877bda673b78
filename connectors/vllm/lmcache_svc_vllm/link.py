"""The plugin's connection to the server: never raises, never blocks for long.

Every call goes through ``ServerLink._guarded``: a failed or slow call is logged once per
outage and answered with ``None`` (a miss, "nothing stored"), and after a failure the server
is not asked at all for ``retry_interval_s``, doubling while it stays down (up to
``MAX_RETRY_INTERVAL_S``, or ``retry_interval_s`` if larger; a ``backoff.Backoff``) -- so a
dead or hung server costs vLLM one timeout now and then, not one per request. On a Unix
socket the wait ends early once the socket file is another one than at the failure (a
restarted server binds a new file; ``socket_watch.py``, an ``os.stat`` at most every
``SOCKET_CHECK_INTERVAL_S`` while waiting): ``RECONNECT_GRACE_S`` later, the time the
client's channel takes to reconnect by itself, the server is tried once per new file, and
if that fails the back-off goes on doubling. The client underneath reconnects by itself and
re-registers the namespace after a server restart.

Bulk bytes take the shared segment when the server's segment is mapped here; otherwise
(another host, or ``use_shm: false``) they are streamed inline. ``reserve``/``publish``
and ``acquire``/``release`` hide the difference from the worker. ``read_in_place`` reads a
load's chunks from the segment without a lease when the server's lookup index locates them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from lmcache_svc.backoff import Backoff
from lmcache_svc.client import CacheClient, LoadLease, LookupResult
from lmcache_svc.client.events import ChunkTokens, EventsSource
from lmcache_svc.client.in_place import InPlaceRead
from lmcache_svc.client.store_pool import PooledSlot, StorePool
from lmcache_svc.errors import LMCacheSvcError, ServerUnavailable
from lmcache_svc.keys import Namespace, NamespaceId
from lmcache_svc.results import Placement
from lmcache_svc_vllm.config import ConnectorConfig
from lmcache_svc_vllm.socket_watch import RECONNECT_GRACE_S, SocketWatch, socket_path

logger = logging.getLogger(f"vllm.{__name__}")
T = TypeVar("T")
MAX_RETRY_INTERVAL_S = 30.0


@dataclass(slots=True)
class Reservation:
    """Writable chunk buffers for a store; ``hashes[i]`` is written into ``buffers[i]``.
    The first ``len(pooled)`` buffers are slots taken from the store pool."""

    hashes: list[bytes]
    buffers: list[memoryview]
    inline: bool
    pooled: list[PooledSlot] = field(default_factory=list)


@dataclass(slots=True)
class Acquired:
    """Readable buffers of the available prefix of the requested chunks; ``offsets``:
    where each starts in the server's shared segment (empty: they are not in it)."""

    buffers: list[memoryview]
    lease: LoadLease | None
    offsets: Sequence[int] = ()


class ServerLink:
    """One namespace's view of the server, shared by the threads of one connector half."""

    def __init__(
        self,
        config: ConnectorConfig,
        namespace: Namespace,
        client_name: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: monotonic seconds for the back-off and the socket checks (tests)."""
        self.config = config
        self.namespace = namespace
        address = config.url or _default_address()
        self._client = CacheClient(
            address,
            timeout_s=config.rpc_timeout_ms / 1000,
            client_name=client_name,
            use_shm=config.use_shm,
            auth_token=config.resolved_auth_token(),
            local_lookup=config.local_lookup,
        )
        self._namespace_id: NamespaceId | None = None
        base_s = config.retry_interval_s
        self._backoff = Backoff(base_s, max(base_s, MAX_RETRY_INTERVAL_S), clock=clock)
        path = socket_path(address)
        self._watch = None if path is None else SocketWatch(path, clock=clock)
        self._outage_logged = False
        self._shm_mapped = False  # the segment was mapped here once: same host, use it
        self._warned: dict[str, float] = {}
        self._lock = threading.Lock()
        self._pool: StorePool | None = None

    # -- guarded calls -------------------------------------------------------------------

    def _guarded(
        self, what: str, call: Callable[[NamespaceId], T], *, proves_up: bool = True
    ) -> T | None:
        """``proves_up=False``: a call that can succeed without reaching the server (it
        neither ends an outage nor resets the back-off)."""
        if self._waiting():
            return None
        try:
            result = call(self._ensure_registered())
        except ServerUnavailable as e:
            self._mark_down(what, e)
            return None
        except LMCacheSvcError as e:
            self._warn(what, e)
            return None
        except Exception as e:  # never into vLLM: a bug here must not fail a request
            logger.exception("lmcache-svc %s failed unexpectedly", what)
            self._mark_down(what, e)
            return None
        if not proves_up:
            return result
        if self._outage_logged:
            logger.info("lmcache-svc server is reachable again (%s)", what)
            self._outage_logged = False
        self._backoff.succeeded()
        return result

    def _warn(self, what: str, error: Exception) -> None:
        """Log a refused call, at most once a minute per kind of call and error."""
        key = f"{what}/{type(error).__name__}"
        now = time.monotonic()
        if now - self._warned.get(key, -60.0) >= 60.0:
            self._warned[key] = now
            logger.warning("lmcache-svc %s failed: %s", what, error)

    def _ensure_registered(self) -> NamespaceId:
        with self._lock:
            if self._namespace_id is None:
                self._namespace_id = self._client.register_namespace(self.namespace)
            return self._namespace_id

    def _waiting(self) -> bool:
        """Whether the back-off lasts. It ends early, ``RECONNECT_GRACE_S`` from now, when
        the server's socket file was replaced since the failure (a restarted server): one
        try, and a failure records the new file and the back-off goes on doubling."""
        if not self._backoff.waiting():
            return False
        if self._watch is None or not self._watch.replaced():
            return True
        self._backoff.end_wait(within_s=RECONNECT_GRACE_S)
        logger.info(
            "lmcache-svc server socket %s was replaced (a restarted server?): next try "
            "within %.1f s, not at the end of the back-off",
            self._watch.path,
            RECONNECT_GRACE_S,
        )
        return self._backoff.waiting()

    def _mark_down(self, what: str, error: Exception) -> None:
        if self._watch is not None:
            self._watch.record()
        wait_s = self._backoff.failed()
        if not self._outage_logged:
            logger.warning(
                "lmcache-svc server unavailable during %s (%s); serving without it, "
                "next try in %.1f s",
                what,
                error,
                wait_s,
            )
            self._outage_logged = True

    @property
    def is_down(self) -> bool:
        """Whether the link waits out a back-off (the server is not asked)."""
        return self._waiting()

    def connect(self) -> None:
        """Register the namespace now (at start-up), so the first lookup is one call; with
        ``local_lookup``, also open the session that maps the server's lookup index."""
        self._guarded("register_namespace", lambda ns: ns)
        if self.config.local_lookup:
            self._use_shm()

    def warm_up(self) -> None:
        """Worker start-up: register, open the session and map the shared segment now,
        so the first save or load does not pay for it."""
        self.connect()
        self._use_shm()

    # -- scheduler side ------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> LookupResult | None:
        """The leading chunks the server holds; ``None`` when it could not tell in time."""
        timeout_s = self.config.lookup_timeout_ms / 1000
        return self._guarded(
            "lookup", lambda ns: self._client.lookup(ns, hashes, timeout_s=timeout_s)
        )

    def lookup_local(self, hashes: Sequence[bytes]) -> LookupResult | None:
        """The lookup index's answer, on the calling thread and with no round trip; None
        when it cannot be had that way (then ``lookup``)."""
        ns_id = self._namespace_id
        if ns_id is None or self.is_down:
            return None
        try:
            return self._client.lookup_local(ns_id, hashes)
        except Exception:  # never into vLLM's scheduler: ask the server instead
            logger.exception("lmcache-svc: a lookup in the shared index failed")
            return None

    # -- worker side: stores -------------------------------------------------------------

    def reserve(self, hashes: Sequence[bytes], chunk_bytes: int) -> Reservation | None:
        """Buffers to write for the chunks the server wants (not stored, room available)."""
        shm = self._use_shm()
        if shm is None:  # no copies for a server that will not take them
            return None
        if not shm:
            return Reservation(
                list(hashes), [memoryview(bytearray(chunk_bytes)) for _ in hashes], True
            )
        pool = self._store_pool()
        pooled = pool.take(len(hashes)) if pool is not None else []
        rest = hashes[len(pooled) :]
        slots = (
            self._guarded("prepare_store", lambda ns: self._client.prepare_store(ns, rest))
            if rest
            else []
        )
        if slots is None:
            slots = []
            if not pooled:
                return None
        wanted = [(s.chunk_hash, s.buffer) for s in slots if s.status == "reserved" and s.buffer]
        return Reservation(
            [*hashes[: len(pooled)], *(h for h, _ in wanted)],
            [*(p.buffer for p in pooled), *(b for _, b in wanted)],
            False,
            pooled,
        )

    def _store_pool(self) -> StorePool | None:
        """The pool of slots reserved ahead (created once the namespace is registered)."""
        if self.config.tuning.store_pool_chunks == 0:
            return None
        with self._lock:
            if self._pool is None and self._namespace_id is not None:
                self._pool = StorePool(
                    self._client, self._namespace_id, max_slots=self.config.tuning.store_pool_chunks
                )
            return self._pool

    def publish(
        self,
        reservation: Reservation,
        *,
        abort: bool = False,
        described: ChunkTokens | None = None,
    ) -> int:
        """Commit (or give back) a reservation's chunks; returns the chunks now stored.
        Pooled slots are bound to their chunks (or, on abort, go back to the pool).
        ``described``: the chunks' tokens, sent when the server publishes KV events."""
        if described is not None and self.events_source() is None:
            described = None
        if not reservation.hashes:
            return 0
        if reservation.inline:
            if abort:
                return 0
            items = list(zip(reservation.hashes, reservation.buffers))
            stored = self._guarded(
                "put", lambda ns: self._client.put(ns, items, described=described)
            )
            return stored or 0
        num_pooled = len(reservation.pooled)
        pooled_hashes, prepared = reservation.hashes[:num_pooled], reservation.hashes[num_pooled:]
        stored = 0
        if num_pooled and self._pool is not None:
            if abort:
                self._pool.abort(reservation.pooled)
            else:
                pool = self._pool
                bound = self._guarded(
                    "commit_store",
                    lambda ns: pool.bind(pooled_hashes, reservation.pooled, described=described),
                )
                stored += bound or 0
        if prepared:
            committed = self._guarded(
                "commit_store",
                lambda ns: self._client.commit_store(
                    ns, prepared, abort=abort, described=described
                ),
            )
            stored += committed or 0
            if committed is not None and not abort and self._pool is not None:
                self._pool.refill_soon()  # the server answered: fill the pool for next time
        return stored

    def events_source(self) -> EventsSource | None:
        """Where the server announces this namespace's chunks (None: not published, or
        not known yet)."""
        ns_id = self._namespace_id
        return None if ns_id is None else self._client.events_source(ns_id)

    def register(self) -> tuple[bool, EventsSource | None]:
        """Register the namespace now (again): whether the server answered, and the
        namespace's event source. A restarted server publishes a namespace's topic only
        once the namespace is registered there."""
        answered = self._guarded("register_namespace", lambda ns: self._client.register_namespace(
            self.namespace))  # fmt: skip
        return answered is not None, self.events_source()

    # -- worker side: loads --------------------------------------------------------------

    def acquire(self, hashes: Sequence[bytes]) -> Acquired | None:
        """Buffers of the longest available prefix of ``hashes`` (pinned until release)."""
        shm = self._use_shm()
        if shm is None:
            return None
        if not shm:
            found = self._guarded("get", lambda ns: self._client.get(ns, hashes))
            if found is None:
                return None
            prefix = _leading(found)
            return Acquired([memoryview(bytearray(b)) for b in prefix], None)
        lease = self._guarded("prepare_load", lambda ns: self._client.prepare_load(ns, hashes))
        if lease is None:
            return None
        return Acquired(list(lease.buffers), lease, lease.offsets)

    def read_in_place(
        self, hashes: Sequence[bytes], placement: Placement | None = None
    ) -> InPlaceRead | None:
        """Views of every chunk's bytes in the mapped segment, located through the server's
        lookup index (or where the scheduler's lookup found them: ``placement``) with no
        round trip and no lease; None when they cannot all be (then ``acquire``). The
        caller checks ``unchanged()`` after its copies and ``touch``es."""
        ns_id = self._namespace_id
        if ns_id is None or not self._shm_mapped or self.is_down:
            return None
        try:
            return self._client.read_in_place(ns_id, hashes, placement)
        except Exception:  # never into vLLM: a lease is taken instead
            logger.exception("lmcache-svc: reading chunks in place failed")
            return None

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Tell the server about chunks read in place (they stay recently used)."""
        self._guarded("touch", lambda ns: self._client.touch(ns, hashes))

    def release(self, acquired: Acquired) -> None:
        lease = acquired.lease
        if lease is not None and lease.lease_id is not None:
            self._guarded("release_load", lambda ns: self._client.release_load(lease))

    def _use_shm(self) -> bool | None:
        """Whether bulk bytes go through the shared segment; None: the server is down.

        "No segment" also answers a server that is down (the client cannot tell), so it
        proves nothing, and once the segment has been mapped here the answer stays yes: a
        session that died with its server is reopened by the next prepare call, under its
        deadline. Otherwise every retry against a dead server would reset the back-off and
        copy the step's KV for an inline put that cannot succeed."""
        if self.is_down:
            return None
        if not self.config.use_shm:
            return False
        if self._shm_mapped:
            return True
        mapped = self._guarded(
            "open_session", lambda ns: self._client.shm_available, proves_up=False
        )
        self._shm_mapped = bool(mapped)
        return mapped

    def close(self) -> None:
        pool, self._pool = self._pool, None
        try:
            if pool is not None:
                pool.close()  # gives its slots back while the session is still open
            self._client.close()
        except Exception:  # shutting down: nothing useful to do with it
            logger.debug("closing the lmcache-svc client failed", exc_info=True)


def _leading(found: list[bytes | None]) -> list[bytes]:
    prefix: list[bytes] = []
    for data in found:
        if data is None:
            break
        prefix.append(data)
    return prefix


def _default_address() -> str:
    from lmcache_svc.client import default_address

    return default_address()

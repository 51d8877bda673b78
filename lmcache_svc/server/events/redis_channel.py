"""What servers sharing one Redis tell each other: a Redis pub/sub channel of stores and
deletes, so each node's event stream shows chunks other nodes wrote (``STORAGE`` /
``REMOTE``).

A server sends one message per short batch on ``<key_prefix>events``: its sender id (random
per start-up) and, per chunk, whether it was written to or removed from Redis, its key and,
for a write, its parent hash and token ids. A receiver checks each described chunk against
its hash (the hash is sha256 over the parent and the tokens, ``keys.chunk_hash``), so a
message can only announce a chunk truthfully, and ignores namespaces it does not publish.

Why a channel (and its limits), rather than keyspace notifications or announcing at the
first lookup: a notification carries the key but not the tokens, which the events need;
announcing at lookup would tell a router only what this node was already asked for. The
channel is at-most-once: messages sent while a receiver is disconnected (a Redis node it
listened to died, a network cut) are lost, and a chunk Redis itself evicts or expires is not
announced as removed; after an outage the Redis tier is resynced from a scan
(``lower_tier_manager.py``), which removes what is gone and announces what it finds new
from the descriptions stored in the values (``tiers/described.py``). In a Redis Cluster a
PUBLISH reaches every node's subscribers, so a receiver listens on any live node and moves
to another when it fails.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgspec
import redis

from lmcache_svc.keys import CHUNK_KEY_BYTES, ChunkKey
from lmcache_svc.server.events.meta import ChunkMeta

if TYPE_CHECKING:
    from lmcache_svc.config import Config
    from lmcache_svc.server.events.node_stream import NodeEvents
    from lmcache_svc.tiers.base import Tier

log = logging.getLogger(__name__)

MAX_QUEUED = 100_000
"""Announcements waiting to be sent at most; older ones are dropped (counted)."""
_BATCH_WAIT_S = 0.01


class ChannelItem(msgspec.Struct, array_like=True):
    stored: bool
    key: bytes
    parent: bytes = b""
    tokens: bytes = b""


class ChannelMessage(msgspec.Struct, array_like=True):
    sender: bytes
    items: list[ChannelItem]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ChannelMessage)


class RedisChannel:
    def __init__(
        self,
        nodes: list[tuple[str, int, dict[str, Any]]],
        channel: bytes,
        tier: Tier,
        events: NodeEvents,
        *,
        timeout_s: float = 2.0,
    ) -> None:
        self._nodes = nodes
        self._channel = channel
        self._tier = tier
        self._events = events
        self._timeout_s = timeout_s
        self._sender_id = os.urandom(8)
        self._queue: deque[ChannelItem] = deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._send_loop, name="events-redis-send", daemon=True),
            threading.Thread(target=self._receive_loop, name="events-redis-recv", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @classmethod
    def for_config(cls, config: Config, tier: Tier, events: NodeEvents) -> RedisChannel:
        r = config.redis
        assert r.url is not None
        nodes = _cluster_nodes(r.url, r.timeout_s) if r.cluster else [_node_of(r.url)]
        return cls(nodes, f"{r.key_prefix}events".encode(), tier, events, timeout_s=r.timeout_s)

    # -- sending ---------------------------------------------------------------------------

    def announce(self, key: ChunkKey, meta: ChunkMeta | None, stored: bool) -> None:
        """Queue a write (with its description) or a delete of this server's (never blocks)."""
        if stored and meta is None:
            return
        item = ChannelItem(stored, bytes(key))
        if meta is not None and stored:
            item.parent, item.tokens = meta.parent, meta.tokens
        with self._cond:
            if len(self._queue) >= MAX_QUEUED:
                self._queue.popleft()
                self._events.metrics.remote_messages.labels(kind="dropped").inc()
            self._queue.append(item)
            self._cond.notify()

    def _send_loop(self) -> None:
        client: redis.Redis | None = None
        while not self._stop.is_set():
            with self._cond:
                while not self._queue and not self._stop.is_set():
                    self._cond.wait(0.5)
                items = list(self._queue)
                self._queue.clear()
            if not items:
                continue
            payload = _ENCODER.encode(ChannelMessage(self._sender_id, items))
            try:
                client = client or self._connect()
                client.publish(self._channel, payload)
                self._events.metrics.remote_messages.labels(kind="sent").inc()
            except (redis.RedisError, OSError) as e:
                log.warning("events: Redis announce channel: publish failed: %s", e)
                self._events.metrics.remote_messages.labels(kind="failed").inc()
                client = None
            self._stop.wait(_BATCH_WAIT_S)

    # -- receiving -------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        while not self._stop.is_set():
            try:
                pubsub = self._connect().pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self._channel)
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=0.2)
                    if message is not None and message.get("type") == "message":
                        self._received(message["data"])
                pubsub.close()
            except (redis.RedisError, OSError) as e:
                log.warning("events: Redis announce channel: listening failed: %s", e)
                self._stop.wait(0.5)

    def _received(self, data: bytes) -> None:
        try:
            message = _DECODER.decode(data)
        except msgspec.MsgspecError:
            self._events.metrics.remote_messages.labels(kind="bad").inc()
            return
        if message.sender == self._sender_id:
            return
        self._events.metrics.remote_messages.labels(kind="received").inc()
        for item in message.items:
            if len(item.key) != CHUNK_KEY_BYTES:
                self._events.metrics.remote_messages.labels(kind="bad").inc()
                continue
            key = ChunkKey(item.key)
            meta = ChunkMeta(item.parent, item.tokens) if item.stored else None
            if not self._events.remote_changed(self._tier, key, meta):
                self._events.metrics.remote_messages.labels(kind="bad").inc()

    # -- connections -----------------------------------------------------------------------

    def _connect(self) -> redis.Redis:
        """A connection to the first node that answers (any node of a cluster will do)."""
        last: Exception | None = None
        for host, port, options in self._nodes:
            client = redis.Redis(
                host=host,
                port=port,
                socket_timeout=self._timeout_s,
                socket_connect_timeout=self._timeout_s,
                **options,
            )
            try:
                client.ping()
                return client
            except (redis.RedisError, OSError) as e:
                last = e
                client.close()
        raise redis.ConnectionError(f"no Redis node answered: {last}")

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        deadline = time.monotonic() + 5
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _node_of(url: str) -> tuple[str, int, dict[str, Any]]:
    parts = urlsplit(url)
    options: dict[str, Any] = {}
    if parts.password:
        options["password"] = parts.password
    if parts.username:
        options["username"] = parts.username
    if parts.scheme == "rediss":
        options["ssl"] = True
    return parts.hostname or "127.0.0.1", parts.port or 6379, options


def _cluster_nodes(url: str, timeout_s: float) -> list[tuple[str, int, dict[str, Any]]]:
    """Every node of the cluster (the URL's node first), from its topology."""
    host, port, options = _node_of(url)
    nodes = [(host, port, options)]
    try:
        client = redis.Redis(
            host=host, port=port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            **options,
        )  # fmt: skip
        reply = client.execute_command("CLUSTER", "NODES")
        client.close()
        # redis-py parses the reply into {"host:port@bus": {...}} (older: the raw text)
        text = reply if isinstance(reply, bytes | str) else "\n".join(f"- {k}" for k in reply)
        text = text.decode() if isinstance(text, bytes) else text
        for line in text.splitlines():
            h, _, p = line.split()[1].split("@")[0].rpartition(":")
            if (h, int(p)) != (host, port):
                nodes.append((h, int(p), options))
    except (redis.RedisError, OSError, ValueError, IndexError) as e:
        log.warning("events: cannot read the cluster's nodes (%s); listening on %s only", e, url)
    return nodes

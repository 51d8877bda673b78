"""KV events: the sidecar's tiers announced in this engine's own stream (``take_events``).

Scheduler half. The server publishes what its tiers hold on a ZMQ stream in vLLM's format,
with block hashes of its own (``lmcache_svc/server/events/node_stream.py``). ``EngineEvents``
subscribes to its namespace's topic, takes a snapshot at start (and after a gap it cannot
replay, or a server restart), and re-announces each chunk in this engine's terms: block
hashes computed with vLLM's own ``hash_block_tokens`` and this engine's hash function and
``NONE_HASH``, chained from the parent chunk's last block (a bounded map from the server's
block hashes to the engine's), ``block_size`` the engine's, medium ``CPU``/``STORAGE`` and
locality as the server said. vLLM puts what ``take_events`` returns into the engine's own
event stream, so a router credits the engine with what its sidecar holds, chunks other
engines stored included.

The plugin never emits ``AllBlocksCleared`` (a router would drop the engine's own GPU
blocks with it): a server restart becomes ``BlockRemoved`` for everything announced from
it. Never a removal before its store: removals name only blocks this engine announced.

Decoding uses vLLM's own classes (``vllm.distributed.kv_events``); all of it runs on one
background thread, ``take_events`` only drains a list.

What a save tells the server (each chunk's tokens and parent) is in ``save_tokens.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

from lmcache_svc.client.events import EventsSource
from lmcache_svc_vllm.link import ServerLink

logger = logging.getLogger(f"vllm.{__name__}")

MAX_HASHES = 1 << 20
"""Server block hash -> engine block hash entries kept to chain children (LRU)."""
IDLE_PROBE_S = 2.0
"""With no message for this long, ask the server's epoch (a restart of an idle server)."""
UNPUBLISHED_RETRY_S = 30.0
"""How often to ask again a server that answers but does not publish this namespace."""
_END = -1


class EngineEvents:
    """Subscribes to the sidecar's stream for one namespace; ``take`` drains the events
    in this engine's terms."""

    def __init__(self, link: ServerLink, block_size: int, hash_fn: Any) -> None:
        self._link = link
        self._block_size = block_size
        self._hash_fn = hash_fn
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._engine_of: OrderedDict[int, bytes] = OrderedDict()
        self._announced: dict[tuple[str, str], dict[int, Any]] = {}
        self._out: list[KVCacheEvent] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self.num_unresolved = 0
        self.num_resyncs = 0
        self._thread = threading.Thread(target=self._run, name="lmcache-svc-events", daemon=True)
        self._thread.start()

    def take(self) -> list[KVCacheEvent]:
        with self._lock:
            out, self._out = self._out, []
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.term()

    # -- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            _, source = self._link.register()
            if source is None or source.replay_endpoint is None:
                # the server is down (ask again soon) or does not publish this namespace
                self._stop.wait(1.0 if self._link.is_down else UNPUBLISHED_RETRY_S)
                continue
            try:
                self._follow(source)
            except (TimeoutError, zmq.ZMQError) as e:  # the server went away: start over
                logger.warning("lmcache-svc: the server's KV event stream stopped: %s", e)
                self._stop.wait(1.0)
            except Exception:  # never into vLLM; start over
                logger.exception("lmcache-svc: following the server's KV events failed")
                self._stop.wait(1.0)

    def _follow(self, source: EventsSource) -> None:
        assert source.replay_endpoint is not None
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        sub.connect(source.endpoint)
        replay = _Replay(self._ctx, source.replay_endpoint)
        topic = source.topic.encode()
        try:
            time.sleep(0.2)  # let the subscription reach the server before the snapshot
            epoch, last = self._resync(replay, topic)
            quiet_since = time.monotonic()
            while not self._stop.is_set():
                if not sub.poll(200):
                    if time.monotonic() - quiet_since > IDLE_PROBE_S:
                        quiet_since = time.monotonic()
                        if replay.epoch() != epoch:  # restarted while idle
                            epoch, last = self._resync(replay, topic)
                    continue
                quiet_since = time.monotonic()
                got_topic, seq_frame, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_frame, "big", signed=True)
                if got_topic != topic:
                    continue  # another topic with this one as its prefix
                if seq <= last:  # in the snapshot already, or the server restarted
                    if replay.epoch() != epoch:
                        epoch, last = self._resync(replay, topic)
                    continue
                if seq != last + 1:  # other topics' batches, or missed ones: ask
                    batches = replay.since(last + 1)
                    if not batches or batches[0][0] != last + 1:
                        epoch, last = self._resync(replay, topic)  # restarted, or too late
                        continue
                    for number, batch_topic, batch in batches:
                        if batch_topic == topic:
                            self._apply(self._decoder.decode(batch).events)
                        last = number
                    if seq <= last:
                        continue
                self._apply(self._decoder.decode(payload).events)
                last = seq
        finally:
            sub.close(linger=0)
            replay.close()

    def _resync(self, replay: _Replay, topic: bytes) -> tuple[bytes, int]:
        """Forget what was announced (removals), then announce the server's snapshot. The
        namespace is registered again first: a restarted server publishes a topic (and
        tells its own subscribers of the restart) once a namespace maps to it. Its replay
        socket can answer before its gRPC port does (the client's channel reconnects on its
        own back-off): without the registration the stream would stay silent, so the
        resync waits for it (``_run`` starts over)."""
        answered, _ = self._link.register()
        if not answered:
            raise TimeoutError("the server did not answer the namespace's registration")
        seq, payloads, epoch = replay.snapshot(topic)
        self.num_resyncs += 1
        self._clear()
        for payload in payloads:
            self._apply(self._decoder.decode(payload).events)
        return epoch, seq

    # -- translation ---------------------------------------------------------------------

    def _apply(self, events: Sequence[Any]) -> None:
        out: list[KVCacheEvent] = []
        for event in events:
            if isinstance(event, BlockStored):
                stored = self._stored(event)
                if stored is not None:
                    out.append(stored)
            elif isinstance(event, BlockRemoved):
                removed = self._removed(event)
                if removed is not None:
                    out.append(removed)
            elif isinstance(event, AllBlocksCleared):
                out += self._cleared()
        if out:
            with self._lock:
                self._out += out

    def _stored(self, event: BlockStored) -> BlockStored | None:
        bs = self._block_size
        if event.block_size != bs or len(event.token_ids) != bs * len(event.block_hashes):
            self.num_unresolved += 1
            return None
        parent: bytes | None = None
        if event.parent_block_hash is not None:
            parent = self._engine_of.get(event.parent_block_hash)
            if parent is None:
                self.num_unresolved += 1
                return None
        first_parent = parent
        engine: list[bytes] = []
        for j, server_hash in enumerate(event.block_hashes):
            parent = hash_block_tokens(
                self._hash_fn, parent, event.token_ids[j * bs : (j + 1) * bs], None
            )
            engine.append(parent)
            self._remember(server_hash, parent)
        announced = self._announced.setdefault((event.medium or "", event.locality or ""), {})
        external = [maybe_convert_block_hash(h) for h in engine]
        if all(h in announced for h in event.block_hashes):
            return None
        for server_hash, ext in zip(event.block_hashes, external):
            announced[server_hash] = ext
        return BlockStored(
            block_hashes=external,
            parent_block_hash=None
            if first_parent is None
            else maybe_convert_block_hash(first_parent),  # fmt: skip
            token_ids=list(event.token_ids),
            block_size=bs,
            lora_id=None,
            medium=event.medium,
            lora_name=None,
            group_idx=0,  # the engine's one full-attention group, as its own GPU blocks
            kv_cache_spec_kind="full_attention",
            locality=event.locality,
        )

    def _removed(self, event: BlockRemoved) -> BlockRemoved | None:
        announced = self._announced.get((event.medium or "", event.locality or ""), {})
        gone = [announced.pop(h) for h in event.block_hashes if h in announced]
        if not gone:
            return None
        return BlockRemoved(
            block_hashes=gone, medium=event.medium, group_idx=0, locality=event.locality
        )

    def _cleared(self) -> list[KVCacheEvent]:
        """The server's stream was cleared: remove everything announced from it."""
        out: list[KVCacheEvent] = []
        for (medium, locality), announced in self._announced.items():
            if announced:
                out.append(
                    BlockRemoved(
                        block_hashes=list(announced.values()),
                        medium=medium or None,
                        group_idx=0,
                        locality=locality or None,
                    )
                )
        self._announced.clear()
        return out

    def _clear(self) -> None:
        out = self._cleared()
        if out:
            with self._lock:
                self._out += out

    def _remember(self, server_hash: int, engine_hash: bytes) -> None:
        self._engine_of[server_hash] = engine_hash
        self._engine_of.move_to_end(server_hash)
        if len(self._engine_of) > MAX_HASHES:
            self._engine_of.popitem(last=False)


class _Replay:
    """Requests on the server's replay socket (a DEALER, one request at a time)."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, timeout_ms: int = 5000) -> None:
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._timeout_ms = timeout_ms

    def _ask(self, body: bytes) -> tuple[list[tuple[int, bytes, bytes]], bytes]:
        self._sock.send_multipart((b"", body))
        out: list[tuple[int, bytes, bytes]] = []
        while True:
            if not self._sock.poll(self._timeout_ms):
                raise TimeoutError(f"no answer from the server's replay socket to {body[:9]!r}")
            _, topic, seq, payload = self._sock.recv_multipart()
            number = int.from_bytes(seq, "big", signed=True)
            if number == _END:
                return out, payload
            out.append((number, topic, payload))

    def snapshot(self, topic: bytes) -> tuple[int, list[bytes], bytes]:
        batches, epoch = self._ask(b"snapshot:" + topic)
        seq = int.from_bytes(epoch[16:24], "big", signed=True)
        return seq, [p for _, _, p in batches], epoch[:16]

    def epoch(self) -> bytes:
        return self._ask(b"epoch")[1][:16]

    def since(self, seq: int) -> list[tuple[int, bytes, bytes]]:
        """Buffered batches from ``seq`` on: (seq, topic, payload)."""
        return self._ask(seq.to_bytes(8, "big", signed=True))[0]

    def close(self) -> None:
        self._sock.close(linger=0)


def start_engine_events(link: ServerLink, block_size: int, vllm_config: Any) -> EngineEvents | None:
    """The engine's view of its sidecar, when the engine publishes KV events."""
    events_config = getattr(vllm_config, "kv_events_config", None)
    if events_config is None or not events_config.enable_kv_cache_events:
        return None
    from vllm.utils.hashing import get_hash_fn_by_name

    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    if not hasattr(kv_cache_utils, "NONE_HASH"):
        kv_cache_utils.init_none_hash(hash_fn)
    return EngineEvents(link, block_size, hash_fn)

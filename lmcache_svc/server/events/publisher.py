"""The ZMQ side of the node-level event stream: a PUB socket, a replay socket, a sequence.

Frames on the PUB socket are vLLM's: ``[topic, seq (8 bytes, big-endian), payload]``. The
sequence is one counter for every topic of this server, starting at 0, assigned when a
batch is taken from the pending queue (``EventLog.flush``, under the caller's lock), so it
never goes backwards while the publisher lives and a snapshot can say exactly which
batches it covers.

The replay socket (a ZMQ ROUTER) answers two requests:

- vLLM's: an 8-byte big-endian start sequence. Answer: every buffered batch from there on,
  ``[topic, seq, payload]`` each, then the end marker ``[b"", -1, b""]``. The buffer keeps
  the last ``buffer_steps`` batches.
- ``b"snapshot:" + topic``: every chunk this server announces now on that topic, as
  ``BlockStored`` batches all carrying the sequence ``S`` of the last batch they cover (the
  live stream goes on at ``S + 1``), then ``[b"", -1, epoch]``; and ``b"epoch"``: just
  ``[b"", -1, epoch]``. ``epoch`` is 16 random bytes drawn at start-up followed by the
  current sequence (8 bytes): a subscriber that sees another epoch knows the server
  restarted.

Slow subscribers never slow the store path: callers only append the owner's records of
what changed to ``EventLog.changes`` (no lock); the publisher's thread turns them into
events (the owner's ``apply``, lock held) before it numbers them. Both queues are bounded
by ``max_pending``: past it, each new record makes its caller apply two (the publisher fell
behind: the backlog shrinks without one caller paying for all of it), and an event that
would take the pending events past it drops them instead (the owner counts the drop) and
marks a resync due; until the publisher's next flush no event is queued (records are still
applied: they keep the owner's view of the tiers), and that flush, on the publisher's
thread, numbers one resync per topic (the owner's ``resync``: ``AllBlocksCleared`` and
everything announced then, see ``node_stream.py``) in place of what was dropped. vLLM's
own publisher blocks the caller on a full queue instead; a store path must not wait for a
subscriber. The publisher thread sends with ZMQ's own per-subscriber high-water mark (a
subscriber that does not read loses messages, sees the sequence jump and asks the replay
socket).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import zmq

from lmcache_svc.errors import ConfigError
from lmcache_svc.server.events.format import END_SEQ, Pending, encode_batch, seq_bytes, seq_of

log = logging.getLogger(__name__)

LINGER_S = 0.002
"""How long the publisher waits after the first pending event, so that the chunks of one
store go out in one batch (and the store path is not interrupted once per chunk)."""
SUBSCRIPTION_POLL_S = 0.1
"""How often an idle publisher looks for new subscriptions."""
SnapshotFn = Callable[[bytes], tuple[int, list[list[Pending]]]]
"""topic -> (sequence covered, batches of events)."""
ResyncFn = Callable[[], dict[bytes, list[Pending]]]
"""The events that replace a dropped queue, per topic (called under the owner's lock)."""
APPLY_SLICE = 1024
"""Records the publisher applies per hold of the lock before a flush (a long backlog does not
hold the lock for all of its time)."""
C = TypeVar("C")


@dataclass(slots=True)
class _Batch:
    seq: int
    topic: bytes
    ts: float
    events: list[Pending] | None
    payload: bytes | None = None

    def encoded(self) -> bytes:
        """The payload, encoded once (the two threads may race: both results are equal;
        ``payload`` is set before ``events`` is dropped)."""
        events = self.events
        if events is None:
            assert self.payload is not None
            return self.payload
        payload = encode_batch(self.ts, events)
        self.payload = payload
        self.events = None
        return payload


class EventLog(Generic[C]):
    """The owner's records of what changed, pending events per topic and the buffer of
    numbered batches. ``changes`` takes appends from any thread without a lock (a deque:
    order kept); the rest is not locked itself: the owner (``NodeEvents``) calls it under
    its lock; the publisher's threads copy out of it under that same lock."""

    def __init__(
        self,
        buffer_steps: int,
        max_pending: int,
        resync: ResyncFn,
        apply: Callable[[C], None] = lambda change: None,
    ) -> None:
        # Microseconds since the epoch: a restarted server goes on above where it stopped
        # (subscribers that drop batches older than the last they saw, as Dynamo's indexer
        # does, would otherwise ignore a restarted server until it caught up).
        self.next_seq = time.time_ns() // 1000
        self._pending: dict[bytes, list[Pending]] = {}
        self.num_pending = 0
        self.max_pending = max_pending
        self.ring: deque[_Batch] = deque(maxlen=buffer_steps)
        self._resync = resync
        self.resync_due = False
        self.changes: deque[C] = deque()
        self._apply = apply

    @property
    def ready(self) -> bool:
        """Something to flush."""
        return self.resync_due or self.num_pending > 0 or bool(self.changes)

    def apply_changes(self, limit: int | None = None) -> None:
        """Turn the oldest records (all, or up to ``limit``) into events, in order (lock
        held)."""
        changes, apply = self.changes, self._apply
        for _ in range(len(changes) if limit is None else min(limit, len(changes))):
            apply(changes.popleft())

    def add(self, topic: bytes, events: list[Pending]) -> int:
        """Queue events; the number of events dropped: 0 when queued, else the queue and
        ``events`` (they would exceed ``max_pending``, or a resync is due), and a resync is
        then due (it describes the state these events lead to)."""
        if self.resync_due:
            return len(events)
        if self.num_pending + len(events) > self.max_pending:
            num = self.num_pending + len(events)
            self._pending.clear()
            self.num_pending = 0
            self.resync_due = True
            return num
        self._pending.setdefault(topic, []).extend(events)
        self.num_pending += len(events)
        return 0

    def flush(self) -> int:
        """Apply every record, then number the pending events (one batch per topic), or the
        resync that replaces them; returns the last sequence assigned (``next_seq - 1``)."""
        self.apply_changes()
        if self.resync_due:
            self._pending = self._resync()
            self.resync_due = False
        ts = time.time()
        for topic, events in self._pending.items():
            self.ring.append(_Batch(self.next_seq, topic, ts, events))
            self.next_seq += 1
        self._pending.clear()
        self.num_pending = 0
        return self.next_seq - 1

    def since(self, seq: int) -> list[_Batch]:
        """Buffered batches with a sequence >= ``seq``."""
        out: list[_Batch] = []
        for batch in reversed(self.ring):
            if batch.seq < seq:
                break
            out.append(batch)
        out.reverse()
        return out


class ZmqPublisher:
    """Binds the PUB and replay sockets and runs their two threads."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        lock: threading.Lock,
        log_: EventLog[C],
        snapshot: SnapshotFn,
        hwm: int = 100_000,
        on_sent: Callable[[int], None] = lambda n: None,
        on_lost: Callable[[int], None] = lambda n: None,
        on_subscribed: Callable[[], None] = lambda: None,
    ) -> None:
        self._lock = lock
        self._log = log_
        self._snapshot = snapshot
        self._on_sent, self._on_lost = on_sent, on_lost
        self._on_subscribed = on_subscribed
        self.epoch = os.urandom(16)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)  # a PUB that also hears subscriptions
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every one, not only new topics
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _bind(self._pub, endpoint, "events.endpoint")
        self._replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _bind(self._replay, replay_endpoint, "events.replay_endpoint")
        self._wake = threading.Condition(lock)
        self.idle = False
        """True while the publisher thread waits (or is about to) for something to send:
        set and cleared under the lock; a caller that added a record and then reads it true
        wakes the thread (``wake``), one that reads it false need not (the thread has not
        yet looked, or is awake and looks again before it waits)."""
        self._stop = False
        self._last_sent = -1
        self._threads = [threading.Thread(target=self._run_pub, name="events-pub", daemon=True)]
        if self._replay is not None:
            self._threads.append(
                threading.Thread(target=self._run_replay, name="events-replay", daemon=True)
            )
        for thread in self._threads:
            thread.start()

    def wake(self) -> None:
        """New pending events (caller holds the lock)."""
        self._wake.notify()

    def _run_pub(self) -> None:
        while True:
            self._heard_subscriptions()
            with self._lock:
                if not self._has_work():
                    self.idle = True
                    self._wake.wait(SUBSCRIPTION_POLL_S)
                    self.idle = False
                if not self._has_work():
                    continue
            time.sleep(LINGER_S)  # let a store's other chunks join the batch
            self._apply_backlog()
            with self._lock:
                self._log.flush()
                batches = self._log.since(self._last_sent + 1)
                stop = self._stop
            self._send(batches)
            if stop:
                return

    def _has_work(self) -> bool:
        """Stopping, something to flush, or a batch numbered but not sent (a snapshot's
        flush numbers what was pending; lock held)."""
        ring = self._log.ring
        return self._stop or self._log.ready or (bool(ring) and ring[-1].seq > self._last_sent)

    def _apply_backlog(self) -> None:
        """Apply the records there are now in slices of ``APPLY_SLICE``, the lock released
        between them, until less than a slice is left (the flush applies it and whatever
        came meanwhile: stores that keep coming do not put the flush off)."""
        todo = len(self._log.changes)
        while todo > APPLY_SLICE:
            with self._lock:
                self._log.apply_changes(APPLY_SLICE)
            todo -= APPLY_SLICE

    def _heard_subscriptions(self) -> None:
        """A subscriber (re)connected: tell the owner (it may repeat a restart's clear)."""
        heard = False
        while self._pub.poll(0):
            frame = self._pub.recv()
            heard = heard or frame[:1] == b"\x01"
        if heard:
            self._on_subscribed()

    def _send(self, batches: list[_Batch]) -> None:
        if not batches:
            return
        first = batches[0].seq
        if first > self._last_sent + 1:  # fell out of the buffer before we sent them
            self._on_lost(first - self._last_sent - 1)
        for batch in batches:
            try:
                self._pub.send_multipart((batch.topic, seq_bytes(batch.seq), batch.encoded()))
            except zmq.ZMQError as e:  # closed under us at shutdown
                log.debug("events: send failed: %s", e)
                return
            self._last_sent = batch.seq
        self._on_sent(len(batches))

    def _run_replay(self) -> None:
        assert self._replay is not None
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while not self._stop:
            try:
                if not poller.poll(100):
                    continue
                frames = self._replay.recv_multipart()
                self._serve(frames)
            except zmq.ZMQError:
                if self._stop:
                    return
                log.exception("events: replay request failed")
            except Exception:  # a bad request must not stop the replay thread
                log.exception("events: replay request failed")

    def _serve(self, frames: list[bytes]) -> None:
        assert self._replay is not None
        if len(frames) != 3 or frames[1] != b"":
            log.warning("events: malformed replay request of %d frames", len(frames))
            return
        client, _, body = frames
        out = self._replay
        if body.startswith(b"snapshot:"):
            topic = body[len(b"snapshot:") :]
            seq, groups = self._snapshot(topic)
            ts = time.time()
            for events in groups:
                out.send_multipart((client, b"", topic, seq_bytes(seq), encode_batch(ts, events)))
            out.send_multipart((client, b"", b"", END_SEQ, self._epoch_frame(seq)))
            return
        if body == b"epoch":
            with self._lock:
                seq = self._log.next_seq - 1
            out.send_multipart((client, b"", b"", END_SEQ, self._epoch_frame(seq)))
            return
        if len(body) != 8:
            log.warning("events: replay request of %d bytes (want an 8-byte sequence)", len(body))
            out.send_multipart((client, b"", b"", END_SEQ, b""))
            return
        with self._lock:
            batches = self._log.since(seq_of(body))
        for batch in batches:
            out.send_multipart((client, b"", batch.topic, seq_bytes(batch.seq), batch.encoded()))
        out.send_multipart((client, b"", b"", END_SEQ, b""))

    def _epoch_frame(self, seq: int) -> bytes:
        return self.epoch + seq_bytes(seq)

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()
        for thread in self._threads:
            thread.join(timeout=5)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


def _bind(sock: zmq.Socket[bytes], endpoint: str, what: str) -> str:
    """Bind ``endpoint`` (``tcp://host:0`` picks a free port); the endpoint bound."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        endpoint = endpoint[:-2] + ":*"
    sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:port too
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise ConfigError(f"{what}: cannot bind {endpoint}: {e}") from None
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) else str(bound)

"""Test-side readers of an event stream: a ZMQ subscriber and replay/snapshot requests,
decoding with the server's structs (``lmcache_svc.server.events.format``). Tests that must prove
vLLM's own classes read the stream use ``vllm_reader.py`` in vLLM's interpreter instead."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from lmcache_svc.server.events.format import KVEventBatch, decode_batch, seq_bytes, seq_of


@dataclass
class Received:
    topic: bytes
    seq: int
    batch: KVEventBatch


@dataclass
class Subscriber:
    endpoint: str
    topic: bytes = b""
    ctx: zmq.Context[Any] = field(default_factory=zmq.Context)
    got: list[Received] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sock.connect(self.endpoint)

    def drain(self, timeout_ms: int = 50) -> list[Received]:
        new: list[Received] = []
        while self.sock.poll(timeout_ms):
            topic, seq, payload = self.sock.recv_multipart()
            new.append(Received(topic, seq_of(seq), decode_batch(payload)))
            timeout_ms = 0
        self.got += new
        return new

    def events(self) -> list[Any]:
        return [e for r in self.got for e in r.batch.events]

    def wait_for(self, check: Callable[[list[Any]], bool], timeout_s: float = 10.0) -> list[Any]:
        """Drain until ``check(all events so far)`` holds; the events."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.drain()
            events = self.events()
            if check(events):
                return events
            if time.monotonic() > deadline:
                raise AssertionError(f"events never satisfied the check; got {events}")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def request(endpoint: str, body: bytes, timeout_ms: int = 5000) -> tuple[list[Received], bytes]:
    """One replay-socket request (a DEALER with the empty delimiter a REQ socket would
    send): the batches answered and the end marker's payload."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", body))
        out: list[Received] = []
        while True:
            if not sock.poll(timeout_ms):
                raise AssertionError(f"no answer from {endpoint} to {body!r}")
            _, topic, seq, payload = sock.recv_multipart()
            if seq_of(seq) == -1:
                return out, payload
            out.append(Received(topic, seq_of(seq), decode_batch(payload)))
    finally:
        sock.close(linger=0)
        ctx.term()


def replay(endpoint: str, start: int) -> list[Received]:
    return request(endpoint, seq_bytes(start))[0]

"""A recording stand-in for the plugin's CUDA copy stream, to test the copy path's ordering.

On the CPU the plugin copies through ``SyncStream``: each copy runs when it is called and
every event is complete when it is made, so a missing wait can never fail a test there,
while on a GPU it would let the forward pass read a layer before its KV arrived, or hand
the server a slot a DMA is still reading or writing. ``RecordingStream`` runs the same CPU
copies at once (so data checks still hold) and models what a CUDA stream promises and what
it does not:

- every tensor op issued while the stream is active (``copy_``, ``index_copy_``,
  ``index_select``) is recorded with the memory it reads and writes, in stream order;
- an event covers the ops recorded before it; an op is complete for the host once an event
  after it was synchronized, and visible to the forward pass (the compute stream) once an
  event after it was waited on there (``wait_on_device``) or synchronized;
- the compute stream's own writes (``write_layer``) are ordered before the copy stream's
  next ops only by ``follow_current``.

The checks, each recorded as a violation (they may run on the plugin's I/O thread):

- ``use_layer(kv)``: the forward pass reads a layer: no copy into it may be pending;
- ``guard(link)``: ``link.release`` of a lease, while a copy still reads its slots;
  ``link.publish`` of a reservation (commit or give back), while a copy still writes them;
- a copy that reads memory the compute stream wrote after the last ``follow_current``;
- two streams: ``side()`` gives a second recording stream (the mover's gathers and
  scatters run there, beside the copies); an op on one that touches memory an op on the
  other touched, reading or writing where either writes, must be ordered after it by an
  event (``record`` there, ``wait_for`` here), or it is a race. Each stream keeps a vector
  clock: which ops of each stream its next op is ordered after.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

Span = tuple[int, int]  # [start, end) of host addresses


def tensor_span(t: torch.Tensor) -> Span:
    if t.numel() == 0:
        return (0, 0)
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return (t.data_ptr(), t.data_ptr() + extent * t.element_size())


def buffer_span(buf: Any) -> Span:
    if len(buf) == 0:
        return (0, 0)
    array = np.frombuffer(buf, dtype=np.uint8)
    return (array.ctypes.data, array.ctypes.data + array.nbytes)


def overlaps(a: Span, b: Span) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@dataclass(frozen=True, slots=True)
class Op:
    stream: int  # 0: the copy stream, 1: its side stream
    seq: int  # position in its stream, from 1
    name: str
    reads: tuple[Span, ...]
    writes: tuple[Span, ...]

    def __str__(self) -> str:
        return f"#{self.seq}{'' if self.stream == 0 else ' (side)'} {self.name}"

    def conflicts(self, other: Op) -> bool:
        """Either writes memory the other reads or writes."""
        return any(overlaps(w, m) for w in self.writes for m in other.reads + other.writes) or any(
            overlaps(r, w) for r in self.reads for w in other.writes
        )


Clock = tuple[int, int]  # per stream: the ops ordered before a point (its stream's vector)


class _Recorder(TorchFunctionMode):
    """Records the data-moving tensor ops issued while the stream is active; an indexed
    op reads or writes only the rows its index names."""

    def __init__(self, stream: RecordingStream) -> None:
        super().__init__()
        self.stream = stream

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "copy_":
            self.stream.enqueue(name, reads=spans(args[1]), writes=spans(args[0]))
        elif name == "index_copy_":
            target, dim, index = args[0], args[1], args[2]
            source = kwargs.get("source", args[-1])
            self.stream.enqueue(name, reads=spans(source), writes=rows(target, dim, index))
        elif name == "index_select":
            self.stream.enqueue(name, reads=rows(args[0], args[1], args[2]), writes=spans(out))
        elif name == "__setitem__" and isinstance(args[2], torch.Tensor):
            target, index = args[0], args[1]
            written = rows(target, 0, index) if isinstance(index, torch.Tensor) else None
            self.stream.enqueue(name, reads=spans(args[2]), writes=written or spans(target[index]))
        return out


def spans(t: torch.Tensor) -> tuple[Span, ...]:
    return (tensor_span(t),)


def rows(t: torch.Tensor, dim: int, index: torch.Tensor) -> tuple[Span, ...]:
    """The rows of ``t`` that ``index`` names along dimension 0 (else all of ``t``)."""
    if dim != 0:
        return spans(t)
    return tuple(tensor_span(t[i]) for i in index.flatten().tolist())


class RecordedEvent:
    def __init__(self, stream: RecordingStream, clock: Clock) -> None:
        self.stream = stream
        self.clock = clock

    def synchronize(self) -> None:
        self.stream.host_synchronized(self.clock)

    def wait_on_device(self) -> None:
        self.stream.device_waited(self.clock)

    def query(self) -> bool:
        return all(c <= d for c, d in zip(self.clock, self.stream.host_done))


class _Shared:
    """What the two streams of one device share: the ops, the log and the checks."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.log: list[str] = []
        self.violations: list[str] = []
        self.host_done: Clock = (0, 0)  # the ops complete, as far as the host knows
        self.device_visible: Clock = (0, 0)  # ... as far as the compute stream knows
        self.num_layer_uses = self.num_releases = self.num_publishes = 0
        self.compute_writes: list[tuple[int, Span]] = []  # (compute clock, memory)
        self.compute_clock = 0
        self.lock = threading.Lock()


def _later(a: Clock, b: Clock) -> Clock:
    return (max(a[0], b[0]), max(a[1], b[1]))


class RecordingStream:
    """A ``CopyStream`` (streams.py) for CPU tensors that records the order of copies,
    event records, waits, releases and commits, and the ones out of order."""

    def __init__(self, *, _main: RecordingStream | None = None) -> None:
        self.device = torch.device("cpu")
        self._shared = _main._shared if _main is not None else _Shared()
        self.index = 0 if _main is None else 1
        self._clock: Clock = (0, 0)
        self._followed = 0  # compute clock this stream was last ordered after
        self._side: RecordingStream | None = None

    # what both streams share, for the tests
    ops = property(lambda self: self._shared.ops)
    log = property(lambda self: self._shared.log)
    violations = property(lambda self: self._shared.violations)
    host_done = property(lambda self: self._shared.host_done)
    num_layer_uses = property(lambda self: self._shared.num_layer_uses)
    num_releases = property(lambda self: self._shared.num_releases)
    num_publishes = property(lambda self: self._shared.num_publishes)

    # -- the CopyStream protocol -----------------------------------------------------------

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        with _Recorder(self):
            yield

    def follow_current(self) -> None:
        sh = self._shared
        with sh.lock:
            self._followed = sh.compute_clock
            sh.log.append(f"follow_current{self._name}")

    def record(self) -> RecordedEvent:
        sh = self._shared
        with sh.lock:
            sh.log.append(f"record{self._name} after #{self._clock[self.index]}")
            return RecordedEvent(self, self._clock)

    def wait_for(self, event: Any) -> None:
        sh = self._shared
        with sh.lock:
            self._clock = _later(self._clock, event.clock)
            sh.log.append(f"wait_for{self._name} {event.clock}")

    def side(self) -> RecordingStream:
        if self.index == 1:
            raise AssertionError("the side stream has no side stream")
        if self._side is None:
            self._side = RecordingStream(_main=self)
        return self._side

    @property
    def _name(self) -> str:
        return "" if self.index == 0 else " (side)"

    # -- what the stream and its events see -------------------------------------------------

    def enqueue(self, name: str, *, reads: tuple[Span, ...], writes: tuple[Span, ...]) -> None:
        sh = self._shared
        with sh.lock:
            clock = list(self._clock)
            clock[self.index] += 1
            self._clock = (clock[0], clock[1])
            op = Op(self.index, clock[self.index], name, reads, writes)
            for other in sh.ops:
                if (
                    other.stream != op.stream
                    and other.seq > self._clock[other.stream]
                    and op.conflicts(other)
                ):
                    sh.violations.append(
                        f"a race: {op} and {other} on the other stream touch the same memory, "
                        "and no event orders them"
                    )
                    break
            sh.ops.append(op)
            sh.log.append(str(op))
            for when, span in sh.compute_writes:
                if when > self._followed and any(overlaps(span, r) for r in op.reads):
                    sh.violations.append(
                        f"copy {op} read KV the compute stream wrote after the copy stream "
                        "last followed it (follow_current)"
                    )
                    break

    def host_synchronized(self, clock: Clock) -> None:
        sh = self._shared
        with sh.lock:
            sh.host_done = _later(sh.host_done, clock)
            sh.device_visible = _later(sh.device_visible, clock)
            sh.log.append(f"synchronize {clock}")

    def device_waited(self, clock: Clock) -> None:
        sh = self._shared
        with sh.lock:
            sh.device_visible = _later(sh.device_visible, clock)
            sh.log.append(f"wait_on_device {clock}")

    # -- the compute stream and the server -------------------------------------------------

    def write_layer(self, kv: torch.Tensor) -> None:
        """The forward pass writes a layer's KV (on the compute stream)."""
        sh = self._shared
        with sh.lock:
            sh.compute_clock += 1
            sh.compute_writes.append((sh.compute_clock, tensor_span(kv)))

    def use_layer(self, kv: torch.Tensor) -> None:
        """The forward pass reads a layer's KV: no copy into it may still be pending."""
        span = tensor_span(kv)
        sh = self._shared
        with sh.lock:
            sh.num_layer_uses += 1
            pending = [
                op
                for op in sh.ops
                if op.seq > sh.device_visible[op.stream]
                and any(overlaps(span, w) for w in op.writes)
            ]
            if pending:
                sh.violations.append(
                    f"a layer was used before the event after its load copies was waited on "
                    f"({len(pending)} pending, first {pending[0]})"
                )

    def guard(self, link: Any) -> None:
        """Check ``link.release`` and ``link.publish`` against the copies (on the instance)."""
        release, publish = link.release, link.publish

        def checked_release(acquired: Any) -> None:
            self._check_done(acquired.buffers, "reads", "a lease was released before its")
            release(acquired)

        def checked_publish(reservation: Any, *, abort: bool = False, **kw: Any) -> int:
            what = "given back" if abort else "committed"
            self._check_done(reservation.buffers, "writes", f"slots were {what} before their")
            return int(publish(reservation, abort=abort, **kw))

        link.release, link.publish = checked_release, checked_publish

    def _check_done(self, buffers: Sequence[Any], access: str, what: str) -> None:
        spans = [buffer_span(b) for b in buffers]
        sh = self._shared
        with sh.lock:
            if access == "reads":
                sh.num_releases += 1
            else:
                sh.num_publishes += 1
            sh.log.append(f"{'release' if access == 'reads' else 'publish'} ({len(spans)})")
            pending = [
                op
                for op in sh.ops
                if op.seq > sh.host_done[op.stream]
                and any(overlaps(s, m) for s in spans for m in getattr(op, access))
            ]
            if pending:
                sh.violations.append(
                    f"{what} copies completed ({len(pending)} pending, first {pending[0]})"
                )

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
- a copy that reads memory the compute stream wrote after the last ``follow_current``.
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
    seq: int  # position in the stream, from 1
    name: str
    reads: tuple[Span, ...]
    writes: tuple[Span, ...]


class _Recorder(TorchFunctionMode):
    """Records the data-moving tensor ops issued while the stream is active."""

    def __init__(self, stream: RecordingStream) -> None:
        super().__init__()
        self.stream = stream

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "copy_":
            self.stream.enqueue(name, reads=[args[1]], writes=[args[0]])
        elif name == "index_copy_":
            self.stream.enqueue(name, reads=[kwargs.get("source", args[-1])], writes=[args[0]])
        elif name == "index_select":
            self.stream.enqueue(name, reads=[args[0]], writes=[out])
        return out


class RecordedEvent:
    def __init__(self, stream: RecordingStream, seq: int) -> None:
        self.stream = stream
        self.seq = seq

    def synchronize(self) -> None:
        self.stream.host_synchronized(self.seq)

    def wait_on_device(self) -> None:
        self.stream.device_waited(self.seq)

    def query(self) -> bool:
        return self.seq <= self.stream.host_done


class RecordingStream:
    """A ``CopyStream`` (streams.py) for CPU tensors that records the order of copies,
    event records, waits, releases and commits, and the ones out of order."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.ops: list[Op] = []
        self.log: list[str] = []
        self.violations: list[str] = []
        self.host_done = 0  # every op up to this one completed, as far as the host knows
        self.device_visible = 0  # ... as far as the compute stream knows
        self.num_layer_uses = self.num_releases = self.num_publishes = 0
        self._compute_writes: list[tuple[int, Span]] = []  # (compute clock, memory)
        self._compute_clock = 0
        self._followed = 0  # compute clock the copy stream was last ordered after
        self._lock = threading.Lock()

    # -- the CopyStream protocol -----------------------------------------------------------

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        with _Recorder(self):
            yield

    def follow_current(self) -> None:
        with self._lock:
            self._followed = self._compute_clock
            self.log.append("follow_current")

    def record(self) -> RecordedEvent:
        with self._lock:
            self.log.append(f"record after #{len(self.ops)}")
            return RecordedEvent(self, len(self.ops))

    # -- what the stream and its events see -------------------------------------------------

    def enqueue(
        self, name: str, *, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]
    ) -> None:
        with self._lock:
            op = Op(
                len(self.ops) + 1,
                name,
                tuple(tensor_span(t) for t in reads),
                tuple(tensor_span(t) for t in writes),
            )
            self.ops.append(op)
            self.log.append(f"#{op.seq} {name}")
            for clock, span in self._compute_writes:
                if clock > self._followed and any(overlaps(span, r) for r in op.reads):
                    self.violations.append(
                        f"copy #{op.seq} ({name}) read KV the compute stream wrote after the "
                        "copy stream last followed it (follow_current)"
                    )
                    break

    def host_synchronized(self, seq: int) -> None:
        with self._lock:
            self.host_done = max(self.host_done, seq)
            self.device_visible = max(self.device_visible, seq)
            self.log.append(f"synchronize #{seq}")

    def device_waited(self, seq: int) -> None:
        with self._lock:
            self.device_visible = max(self.device_visible, seq)
            self.log.append(f"wait_on_device #{seq}")

    # -- the compute stream and the server -------------------------------------------------

    def write_layer(self, kv: torch.Tensor) -> None:
        """The forward pass writes a layer's KV (on the compute stream)."""
        with self._lock:
            self._compute_clock += 1
            self._compute_writes.append((self._compute_clock, tensor_span(kv)))

    def use_layer(self, kv: torch.Tensor) -> None:
        """The forward pass reads a layer's KV: no copy into it may still be pending."""
        span = tensor_span(kv)
        with self._lock:
            self.num_layer_uses += 1
            pending = [
                op
                for op in self.ops
                if op.seq > self.device_visible and any(overlaps(span, w) for w in op.writes)
            ]
            if pending:
                self.violations.append(
                    f"a layer was used before the event after its load copies was waited on "
                    f"({len(pending)} pending, first #{pending[0].seq} {pending[0].name})"
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
        with self._lock:
            if access == "reads":
                self.num_releases += 1
            else:
                self.num_publishes += 1
            self.log.append(f"{'release' if access == 'reads' else 'publish'} ({len(spans)})")
            pending = [
                op
                for op in self.ops
                if op.seq > self.host_done
                and any(overlaps(s, m) for s in spans for m in getattr(op, access))
            ]
            if pending:
                self.violations.append(
                    f"{what} copies completed ({len(pending)} pending, first "
                    f"#{pending[0].seq} {pending[0].name})"
                )

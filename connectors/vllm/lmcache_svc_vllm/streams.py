"""Where KV copies run: a dedicated CUDA stream, or (CPU) synchronously in the caller.

The copy code (``mover.py``) talks to a ``CopyStream`` only, so the same gather/scatter
runs on CPU tensors in CI and on CUDA tensors on a GPU machine:

- ``CudaCopyStream``: copies are enqueued on a stream of their own; ``record`` marks a
  point (a CUDA event) that the forward pass's stream can wait for on the device
  (``wait_on_device``) without blocking the host, or that a background thread waits for on
  the host (``synchronize``) before it hands slots back to the server.
- ``SyncStream``: CPU copies run when called; every event is already complete.

``follow_current`` makes the copy stream wait for the work already queued on the current
(compute) stream, so a save never reads KV that the forward pass has not written yet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch


class CopyEvent(Protocol):
    def synchronize(self) -> None:
        """Block the calling thread until the copies before this point are done."""

    def wait_on_device(self) -> None:
        """Make the current (compute) stream wait for it; the host does not block."""

    def query(self) -> bool:
        """True when the copies before this point are done."""


class CopyStream(Protocol):
    device: torch.device

    def activate(self) -> contextlib.AbstractContextManager[None]:
        """Context in which torch copies are enqueued on this stream."""

    def follow_current(self) -> None:
        """Order this stream's next copies after the work queued on the current stream."""

    def record(self) -> CopyEvent:
        """An event marking the copies enqueued so far."""

    def wait_for(self, event: CopyEvent) -> None:
        """Order this stream's next work after ``event`` (recorded on another stream of the
        same device); the host does not block."""

    def side(self) -> CopyStream:
        """A second stream of the same device for the kernels beside the copies (the
        mover's gathers and scatters), so they overlap the copy engine's transfers; the
        same stream where nothing runs concurrently (CPU)."""


class _DoneEvent:
    def synchronize(self) -> None:
        return None

    def wait_on_device(self) -> None:
        return None

    def query(self) -> bool:
        return True


class SyncStream:
    """CPU: copies run synchronously in the caller, events are complete when made."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        yield

    def follow_current(self) -> None:
        return None

    def record(self) -> CopyEvent:
        return _DoneEvent()

    def wait_for(self, event: CopyEvent) -> None:
        return None

    def side(self) -> CopyStream:
        return self


class _CudaEvent:
    def __init__(self, event: Any, device: torch.device) -> None:
        self._event = event
        self._device = device

    def synchronize(self) -> None:
        self._event.synchronize()

    def wait_on_device(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)

    def query(self) -> bool:
        return bool(self._event.query())


class CudaCopyStream:
    """A dedicated CUDA stream for KV copies (never the default stream)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(device=self.device)
        self._side: CudaCopyStream | None = None

    def activate(self) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.stream(self._stream)

    def follow_current(self) -> None:
        self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def record(self) -> CopyEvent:
        event = torch.cuda.Event()
        event.record(self._stream)
        return _CudaEvent(event, self.device)

    def wait_for(self, event: CopyEvent) -> None:
        assert isinstance(event, _CudaEvent), event
        self._stream.wait_event(event._event)

    def side(self) -> CopyStream:
        if self._side is None:
            self._side = CudaCopyStream(self.device)
        return self._side


def copy_stream_for(device: torch.device) -> CopyStream:
    """The stream KV copies for tensors on ``device`` use."""
    if device.type == "cuda":
        return CudaCopyStream(device)
    return SyncStream(device)

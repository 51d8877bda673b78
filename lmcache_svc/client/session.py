"""A client's session with the server: the open ``OpenSession`` stream, the shared segment
and the lookup-index tables its first event named, mapped here when on the same host.

The server sends one event and holds the stream open for the session's life, so the end
of the stream is the end of the session. It is seen through the call's done callback (run
by gRPC's channel thread), not by a thread of ours reading the stream: gRPC's blocking
read wakes its thread every 100 ms (``grpc._common.MAXIMUM_WAIT_TIMEOUT``) to run Python,
which made every idle client wake ten times a second for nothing (measured in a vLLM
engine: 50 wakes and 5.8-6.6 ms of CPU in 5 s, per process)."""

from __future__ import annotations

from typing import Any

import grpc

from lmcache_svc.client.transport import convert_rpc_error, first_event, map_segment
from lmcache_svc.shm.index_reader import open_index_segments
from lmcache_svc.v1 import cache_pb2 as pb


class Session:
    """An open session stream and the mapped segment; dead once the stream ends."""

    def __init__(self, stream: Any, event: pb.SessionEvent) -> None:  # a grpc stream call
        self.session_id = event.session_id
        self.mapping, self.segment_name = map_segment(event)
        self.indexes = open_index_segments(event.segments)  # lookups without a round trip
        self._stream = stream
        self.alive = True
        stream.add_done_callback(self._ended)  # at once if it has ended already

    @classmethod
    def open(
        cls, stub: Any, client_name: str, metadata: tuple[tuple[str, str], ...], timeout_s: float
    ) -> Session:
        """Open a session (``stub``: a ``CacheServiceStub``); ServerUnavailable if the first
        event does not come within ``timeout_s``."""
        stream = stub.OpenSession(pb.OpenSessionRequest(client_name=client_name), metadata=metadata)
        try:
            event = first_event(stream, timeout_s)
        except grpc.RpcError as e:
            stream.cancel()
            raise convert_rpc_error(e) from None
        return cls(stream, event)

    def _ended(self, _call: Any) -> None:
        self.alive = False

    def close(self) -> None:
        self.alive = False
        self._stream.cancel()

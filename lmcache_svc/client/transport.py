"""The client side of the wire, used by ``CacheClient``: gRPC targets, channel options, error
conversion, the shaping of inline transfers, and the shared segment's slots and leases."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from lmcache_svc import errors
from lmcache_svc.client.defaults import default_socket_path
from lmcache_svc.client.events import ChunkTokens
from lmcache_svc.results import StoreStatus
from lmcache_svc.shm.arena import ARENA_TRANSPORT, ArenaMapping
from lmcache_svc.v1 import cache_pb2 as pb
from lmcache_svc.wire import (
    ERROR_KIND_KEY,
    PIECE_BYTES,
    STORE_STATUS_NAMES,
    channel_options,
    error_from_kind,
)

_UNAVAILABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}
Req = TypeVar("Req", contravariant=True)
Resp = TypeVar("Resp", bound=Message, covariant=True)


class UnaryCall(Protocol[Req, Resp]):
    """A generated stub's unary method (``self._stub.Lookup``, ...), from a request message
    to a response message (the generated types of ``cache_pb2``)."""

    def __call__(
        self, request: Req, *, timeout: float, metadata: tuple[tuple[str, str], ...]
    ) -> Resp: ...


class NamespaceRequest(Protocol):
    """A request on one namespace (``pb.LookupRequest``, ``pb.PrepareStoreRequest``, ...)."""

    namespace_id: bytes


NsReq = TypeVar("NsReq", bound=NamespaceRequest)


RECONNECT_OPTIONS = [
    # Retry a lost server quickly (100 ms, backing off to 1 s). Not min_reconnect_backoff_ms:
    # gRPC also uses it as the time a connection attempt may take, so 100 ms there failed
    # calls whenever the server's handshake was slower (a loaded host, a server starting up).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def default_address() -> str:
    return str(default_socket_path())


def grpc_target(address: str) -> str:
    """``/p.sock`` or ``unix:/p.sock`` -> ``unix:/p.sock``; ``host:port`` unchanged."""
    if address.startswith(("unix:", "unix-abstract:")):
        return address
    if address.startswith(("/", "./")) or address.endswith(".sock"):
        return f"unix:{address}"
    if ":" not in address:
        raise errors.InvalidArgument(
            f"server address {address!r} is neither a socket path nor host:port"
        )
    return address


def convert_rpc_error(error: grpc.RpcError) -> errors.LMCacheSvcError:
    """The project's exception for a failed call (the server sends the error kind)."""
    call = isinstance(error, grpc.Call)
    code = error.code() if call else grpc.StatusCode.UNKNOWN
    details = (error.details() if call else None) or str(error)
    trailing = error.trailing_metadata() if call else None
    kind = dict(trailing or ()).get(ERROR_KIND_KEY)
    if kind:
        return error_from_kind(str(kind), details)
    if code in _UNAVAILABLE:
        return errors.ServerUnavailable(f"lmcache-svc server unavailable ({code.name}): {details}")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return errors.Unauthenticated(details)
    return errors.LMCacheSvcError(f"{code.name}: {details}")


def put_parts(
    namespace_id: bytes,
    items: Sequence[tuple[bytes, Any]],
    described: ChunkTokens | None = None,
) -> Iterator[pb.ChunkPart]:
    """A Put stream; each chunk ``described`` carries its token ids and parent."""
    for chunk_hash, data in items:
        view = memoryview(data).cast("B")
        header = pb.ChunkHeader(namespace_id=namespace_id, chunk_hash=chunk_hash, length=len(view))
        tokens = described.items.get(bytes(chunk_hash)) if described is not None else None
        if tokens is not None:
            header.parent_hash, header.token_ids = tokens
        yield pb.ChunkPart(header=header)
        for i in range(0, len(view), PIECE_BYTES):
            yield pb.ChunkPart(data=bytes(view[i : i + PIECE_BYTES]))


class GetAssembler:
    """Reassembles a Get stream into one ``bytes | None`` per requested chunk."""

    def __init__(self) -> None:
        self.chunks: list[bytes | None] = []
        self._pieces: list[bytes] = []
        self._open = False

    def feed(self, part: pb.ChunkPart) -> None:
        if part.HasField("header"):
            self._close()
            if part.header.found:
                self._open = True
            else:
                self.chunks.append(None)
        else:
            self._pieces.append(part.data)

    def _close(self) -> None:
        if self._open:
            self.chunks.append(b"".join(self._pieces))
            self._pieces, self._open = [], False

    def result(self) -> list[bytes | None]:
        self._close()
        return self.chunks


def memory_parts(blob: bytes | bytearray | memoryview) -> Iterator[pb.MemoryPart]:
    """A PutMemory stream: the header with the blob's length, then its pieces."""
    view = memoryview(blob).cast("B")
    yield pb.MemoryPart(header=pb.MemoryHeader(length=len(view)))
    for i in range(0, len(view), PIECE_BYTES):
        yield pb.MemoryPart(data=bytes(view[i : i + PIECE_BYTES]))


def join_memory_parts(parts: Iterable[pb.MemoryPart]) -> bytes | None:
    """The blob of a GetMemory stream, or None for a miss."""
    pieces: list[bytes] = []
    length: int | None = None
    for part in parts:
        if part.HasField("header"):
            if not part.header.found:
                return None
            length = int(part.header.length)
        else:
            pieces.append(part.data)
    blob = b"".join(pieces)
    if length is None or len(blob) != length:
        raise errors.ServerUnavailable(
            f"GetMemory stream ended after {len(blob)} of {length} bytes; try again"
        )
    return blob


def memory_timeout(timeout_s: float, num_bytes: int) -> float:
    """A bulk transfer's deadline: ``timeout_s`` per started 64 MiB."""
    return timeout_s * (1 + num_bytes // (64 << 20))


def stats_dict(resp: pb.StatsResponse) -> dict[str, Any]:
    return {
        "version": resp.version,
        "active_leases": resp.active_leases,
        "pending_stores": resp.pending_stores,
        "num_namespaces": resp.num_namespaces,
        "tiers": [
            {
                "name": t.name,
                "capacity_bytes": t.capacity_bytes,
                "used_bytes": t.used_bytes,
                "num_chunks": t.num_chunks,
            }
            for t in resp.tiers
        ],
    }


def client_channel_options() -> list[tuple[str, int]]:
    return channel_options() + RECONNECT_OPTIONS


def auth_metadata(auth_token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {auth_token}"),) if auth_token else ()


@dataclass(frozen=True, slots=True)
class StoreSlot:
    """A chunk's answer to ``prepare_store``: write ``buffer`` when status is 'reserved'."""

    chunk_hash: bytes
    status: StoreStatus
    buffer: memoryview | None = None


@dataclass(frozen=True, slots=True)
class LoadLease:
    """Read-only views of the leased prefix's bytes in the shared segment, valid until
    released (writing through one raises ``TypeError``), and where each starts there."""

    lease_id: str | None
    buffers: list[memoryview] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)


def map_segment(event: pb.SessionEvent) -> tuple[ArenaMapping | None, str]:
    """Map the session's shared segment if it is on this host; (mapping or None, name)."""
    for seg in event.segments:
        if seg.transport == ARENA_TRANSPORT:
            # Pre-faulting the client's mapping in the background makes first copies about
            # 5x faster on small VMs (measured in arena.py's docstring).
            return ArenaMapping.open(seg.name, seg.size, seg.nonce, prefault=True), seg.name
    return None, ""


def check_mapping(mapping: ArenaMapping | None, expected: str, segment_name: str) -> ArenaMapping:
    """The mapping to read a response's slots from, or why there is none."""
    if mapping is None:
        raise errors.InvalidArgument(
            "the server's shared segment is not mapped here (another host?); use put/get"
        )
    if segment_name != expected:
        raise errors.ServerUnavailable("the server restarted during the call; try again")
    return mapping


def store_slots(resp: pb.PrepareStoreResponse, mapping: ArenaMapping) -> list[StoreSlot]:
    return [
        StoreSlot(
            s.chunk_hash,
            STORE_STATUS_NAMES[s.status],
            mapping.view(s.offset, s.length) if s.status == pb.RESERVED else None,
        )
        for s in resp.slots
    ]


def load_lease(resp: pb.PrepareLoadResponse, mapping: ArenaMapping) -> LoadLease:
    """The lease's buffers are read-only views: a write through one raises ``TypeError``."""
    slots = resp.slots
    return LoadLease(
        resp.lease_id,
        [mapping.view(s.offset, s.length, writable=False) for s in slots],
        [s.offset for s in slots],
    )


def first_event(stream: Any, timeout_s: float) -> pb.SessionEvent:
    """The session's first event, or ServerUnavailable if it does not come in time."""
    result: list[Any] = []
    done = threading.Event()

    def read() -> None:
        try:
            result.append(next(stream))
        except BaseException as e:  # handed to the caller below
            result.append(e)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(timeout_s):
        stream.cancel()
        raise errors.ServerUnavailable(f"no session from the server within {timeout_s} s")
    if isinstance(result[0], grpc.RpcError):
        raise result[0]
    if isinstance(result[0], BaseException):
        raise errors.ServerUnavailable(f"session stream ended: {result[0]!r}")
    return result[0]

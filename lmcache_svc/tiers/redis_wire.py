"""The Redis tier's value format, its bulk RESP path and its argument checks
(see ``tiers/redis.py``).

A stored value is ``HEADER`` followed by the payload (format version 1), or ``HEADER``, the
chunk's description (``described.py``: 37 + 4 * tokens bytes) and the payload (version 2,
written only when the store carried the description). ``Replies`` reads RESP2 replies from a
connected socket and receives a GET's payload straight into the caller's buffer, checking the
header on the way; ``set_parts`` frames a SET so that header and payload go out as separate
buffers. Outcomes are ``(status, detail)`` pairs; the tier turns them into results or errors.
"""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import redis
import xxhash
from redis.connection import parse_url
from redis.exceptions import RedisClusterException

from lmcache_svc.errors import ConfigError, InvalidArgument
from lmcache_svc.keys import ChunkKey
from lmcache_svc.tiers.base import Buffer, ChunkDescription
from lmcache_svc.tiers.described import DESCRIPTION, TOKEN_BYTES, description_tokens
from lmcache_svc.tiers.described import pack_description as _pack_description

HEADER = struct.Struct("<4sBBHQQ48s")
"""magic, format version, flags, reserved, payload length, xxh3_64(payload), chunk key."""
MAGIC = b"LMCR"
PLAIN_VERSION = 1
"""``HEADER``, then the payload."""
DESCRIBED_VERSION = 2
"""``HEADER``, the chunk's description, then the payload."""
MAX_TOKENS = 1 << 16
"""Tokens of the largest description a value may carry (a bound on damaged headers)."""
HEAD_PROBE = HEADER.size + DESCRIPTION.size
"""Leading bytes of a value that say where its payload starts (``payload_offset``)."""

MIN_SHARD_BYTES = 1 << 20
"""A batch is split over worker connections only in shares of at least this many bytes."""
_GET_WINDOW_BYTES = 4 << 20
"""Bytes of GET replies in flight per connection. Redis copies each reply into an output
buffer of its own before writing it; with 16 MiB in flight per connection it kept taking fresh
memory for them (about 40k page faults per 256 MiB read at 1 MiB values, 1.3 GB/s), with 4 MiB
it reuses what it freed (no faults, 2.0-2.8 GB/s; ``bench tiers``)."""
_READ_BUFFER = 1 << 16
_CRLF = b"\r\n"

Status = Literal["ok", "miss", "oom", "corrupt", "bad_size", "redirect", "error"]
Outcome = tuple[Status, str]
OK: Outcome = ("ok", "")
MISS: Outcome = ("miss", "")
_REDIRECTS = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")
BACKEND_ERRORS = (redis.RedisError, RedisClusterException, OSError)
"""What redis-py and sockets raise; the tier turns them into ``TierError``."""


@dataclass(slots=True)
class Job:
    """One chunk of a batch: ``data`` is the payload to write or the buffer to read into."""

    key: ChunkKey
    rkey: bytes
    data: memoryview
    desc: ChunkDescription | None = None
    """For a write: the description to store with the value."""


def byte_view(data: Buffer, what: str, *, writable: bool = False) -> memoryview:
    """A flat unsigned-byte view of ``data``, or ``InvalidArgument`` naming ``what``."""
    try:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"{what} must be a contiguous byte buffer: {e}") from None
    if writable and view.readonly:
        raise InvalidArgument(f"{what} must be a writable buffer")
    return view


def pack_header(key: bytes, payload: Buffer, desc: ChunkDescription | None = None) -> bytes:
    """Everything a value holds before its payload: ``HEADER``, and the description if any."""
    checksum = xxhash.xxh3_64_intdigest(payload)
    if desc is None:
        return HEADER.pack(MAGIC, PLAIN_VERSION, 0, 0, len(payload), checksum, key)
    header = HEADER.pack(MAGIC, DESCRIBED_VERSION, 0, 0, len(payload), checksum, key)
    return header + _pack_description(desc)


def payload_offset(head: bytes | memoryview, value_size: int) -> int:
    """Where the payload starts in a value whose first bytes are ``head`` (at least
    ``HEADER.size``, and ``HEAD_PROBE`` for version 2); ``ValueError`` saying what is wrong
    with a damaged description (its token count over ``MAX_TOKENS`` or past the value)."""
    if len(head) < HEADER.size or head[4] != DESCRIBED_VERSION:
        return HEADER.size
    offset = HEADER.size + DESCRIPTION.size
    if value_size < offset or len(head) < offset:
        raise ValueError(f"value of {value_size} bytes is shorter than its description")
    offset += TOKEN_BYTES * description_tokens(head[HEADER.size : offset], MAX_TOKENS)
    if offset > value_size:
        raise ValueError(f"description runs past the value's {value_size} bytes")
    return offset


def check_header(
    key: bytes, header: bytes, value_size: int, out_size: int | None, offset: int = HEADER.size
) -> tuple[Outcome, int]:
    """Check a value's header against its key and size (the payload starting at
    ``offset``); returns (outcome, payload checksum)."""
    magic, version, _flags, _reserved, length, checksum, stored_key = HEADER.unpack(header)
    if magic != MAGIC:
        return ("corrupt", f"bad magic {magic!r}"), 0
    if version not in (PLAIN_VERSION, DESCRIBED_VERSION):
        return ("corrupt", f"unknown format version {version}"), 0
    if length != value_size - offset:
        stored = value_size - offset
        return ("corrupt", f"header says {length} payload bytes, value holds {stored}"), 0
    if stored_key != key:
        return ("corrupt", f"header names another chunk key {stored_key.hex()}"), 0
    if out_size is not None and length != out_size:
        return ("bad_size", f"stored payload is {length} bytes, buffer is {out_size}"), 0
    return OK, checksum


def check_payload(payload: Buffer, checksum: int) -> Outcome:
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        return ("corrupt", "payload checksum mismatch")
    return OK


def check_value(key: bytes, value: bytes | None, out: memoryview) -> Outcome:
    """Check a whole value fetched by redis-py and copy its payload into ``out``."""
    if value is None:
        return MISS
    if len(value) < HEADER.size:
        return ("corrupt", f"value of {len(value)} bytes is shorter than its header")
    try:
        offset = payload_offset(memoryview(value)[:HEAD_PROBE], len(value))
    except ValueError as e:
        return ("corrupt", str(e))
    outcome, checksum = check_header(key, value[: HEADER.size], len(value), len(out), offset)
    if outcome != OK:
        return outcome
    payload = memoryview(value)[offset:]
    outcome = check_payload(payload, checksum)
    if outcome == OK:
        out[:] = payload
    return outcome


def payload_size(key: bytes, head: bytes, value_size: int) -> int | str:
    """Payload length from a value's first ``HEAD_PROBE`` bytes (fewer when the value is
    shorter), or the reason the header is bad."""
    if value_size < HEADER.size or len(head) < HEADER.size:
        return f"value of {value_size} bytes is shorter than its header"
    try:
        offset = payload_offset(head, value_size)
    except ValueError as e:
        return str(e)
    outcome, _ = check_header(key, head[: HEADER.size], value_size, None, offset)
    return outcome[1] if outcome != OK else value_size - offset


def error_outcome(message: str) -> Outcome:
    code = message.split(" ", 1)[0]
    if code == "OOM":
        return ("oom", message)
    if code == "WRONGTYPE":
        return ("corrupt", "key holds a non-string value")
    if code in _REDIRECTS:
        return ("redirect", message)
    return ("error", message)


def pack(*args: bytes) -> bytes:
    """One RESP command from small arguments."""
    parts = [b"*%d\r\n" % len(args)]
    parts.extend(b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in args)
    return b"".join(parts)


def set_parts(rkey: bytes, header: bytes, payload: memoryview, ttl_ms: int | None) -> list[Any]:
    """``SET rkey header+payload [PX ttl_ms]`` as three buffers; the payload is not copied."""
    num_args = 3 if ttl_ms is None else 5
    size = len(header) + len(payload)
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (num_args, len(rkey), rkey, size, header)
    ttl = b"" if ttl_ms is None else b"$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(ttl_ms)), ttl_ms)
    tail = _CRLF + ttl
    return [head, payload, tail]


def get_window(value_size: int, num_jobs: int) -> int:
    """How many GETs one connection keeps in flight."""
    return max(1, min(num_jobs, 64, _GET_WINDOW_BYTES // max(value_size, 1)))


def socket_of(conn: Any) -> socket.socket:
    """The connected socket of a redis-py ``Connection`` (redis-py keeps it in ``_sock``).

    Only connections whose replies were all consumed are handed out by the pool, so nothing
    is left in redis-py's own read buffer when the bulk path takes over the socket.
    """
    if getattr(conn, "_sock", None) is None:
        conn.connect()
    sock = conn._sock
    if sock is None:
        raise redis.ConnectionError("connection has no socket after connect()")
    return sock


class Replies:
    """Reads RESP2 replies from one socket; bulk payloads go straight into caller buffers."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(_READ_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def status(self) -> Outcome:
        """The reply to a SET: ``+OK`` or an error."""
        line = self._line()
        if line.startswith(b"+"):
            return OK
        if line.startswith(b"-"):
            return error_outcome(line[1:].decode(errors="replace"))
        raise redis.InvalidResponse(f"unexpected reply to SET: {line[:80]!r}")

    def value_into(self, key: bytes, out: memoryview) -> Outcome:
        """The reply to a GET: header checked, payload received into ``out`` and checked."""
        line = self._line()
        if line.startswith(b"-"):
            return error_outcome(line[1:].decode(errors="replace"))
        if line == b"_":  # RESP3 null
            return MISS
        if not line.startswith(b"$"):
            raise redis.InvalidResponse(f"unexpected reply to GET: {line[:80]!r}")
        size = int(line[1:])
        if size < 0:
            return MISS
        if size < HEADER.size:
            self._skip(size + 2)
            return ("corrupt", f"value of {size} bytes is shorter than its header")
        header = self._take(HEADER.size)
        offset = HEADER.size
        if header[4] == DESCRIBED_VERSION:
            if size < HEAD_PROBE:
                self._skip(size - HEADER.size + 2)
                return ("corrupt", f"value of {size} bytes is shorter than its description")
            try:
                offset = payload_offset(header + self._take(DESCRIPTION.size), size)
            except ValueError as e:
                self._skip(size - HEAD_PROBE + 2)
                return ("corrupt", str(e))
            self._skip(offset - HEAD_PROBE)
        outcome, checksum = check_header(key, header, size, len(out), offset)
        if outcome != OK:
            self._skip(size - offset + 2)
            return outcome
        self._read_into(out)
        self._skip(2)
        return check_payload(out, checksum)

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(_CRLF, self._start, self._end)
            if end >= 0:
                line = bytes(self._view[self._start : end])
                self._start = end + 2
                return line
            self._fill()

    def _take(self, n: int) -> bytes:
        while self._end - self._start < n:
            self._fill()
        data = bytes(self._view[self._start : self._start + n])
        self._start += n
        return data

    def _read_into(self, out: memoryview) -> None:
        got = min(len(out), self._end - self._start)
        out[:got] = self._view[self._start : self._start + got]
        self._start += got
        while got < len(out):
            got += self._recv(out[got:])

    def _skip(self, n: int) -> None:
        buffered = min(n, self._end - self._start)
        self._start += buffered
        n -= buffered
        while n > 0:
            self._start = self._end = 0
            n -= self._recv(self._view[: min(n, len(self._view))])

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            if self._start == 0:
                raise redis.InvalidResponse("reply line longer than the read buffer")
            kept = self._end - self._start
            self._view[:kept] = self._view[self._start : self._end]
            self._start, self._end = 0, kept
        self._end += self._recv(self._view[self._end :])

    def _recv(self, into: memoryview) -> int:
        n = self._sock.recv_into(into)
        if n == 0:
            raise redis.ConnectionError("connection closed by the Redis server")
        return n


Stream = Callable[[list[Job], Any], list[Outcome]]


def stream_shard(pool: Any, jobs: list[Job], stream: Stream) -> list[Outcome]:
    """Run ``stream`` on one pooled connection. A dropped connection (not a timeout) marks
    the jobs ``redirect``: redis-py's own commands then reconnect and follow the topology."""
    try:
        conn = pool.get_connection()
    except BACKEND_ERRORS as e:
        if is_timeout(e):
            raise
        return [("redirect", str(e))] * len(jobs)
    try:
        return stream(jobs, conn)
    except BaseException as e:
        conn.disconnect()
        if isinstance(e, BACKEND_ERRORS) and not is_timeout(e):
            return [("redirect", str(e))] * len(jobs)
        raise
    finally:
        pool.release(conn)


def send_sets(jobs: list[Job], conn: Any, ttl_ms: int | None) -> list[Outcome]:
    """Pipeline one SET per job, header and payload sent as separate buffers."""
    for job in jobs:
        header = pack_header(job.key, job.data, job.desc)
        conn.send_packed_command(set_parts(job.rkey, header, job.data, ttl_ms), False)
    replies = Replies(socket_of(conn))
    return [replies.status() for _ in jobs]


def fetch_values(jobs: list[Job], conn: Any) -> list[Outcome]:
    """Pipeline one GET per job, a window of them in flight, each received into its buffer."""
    sock = socket_of(conn)
    ahead = get_window(len(jobs[0].data), len(jobs))
    sock.sendall(b"".join(pack(b"GET", job.rkey) for job in jobs[:ahead]))
    replies = Replies(sock)
    outcomes = []
    for n, job in enumerate(jobs):
        outcomes.append(replies.value_into(job.key, job.data))
        if n + ahead < len(jobs):
            sock.sendall(pack(b"GET", jobs[n + ahead].rkey))
    return outcomes


def glob_escape(pattern: bytes) -> bytes:
    """Escape Redis glob characters so a key prefix matches only itself."""
    out = bytearray()
    for byte in pattern:
        if byte in b"*?[]\\":
            out += b"\\"
        out.append(byte)
    return bytes(out)


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***``, for messages and logs."""
    try:
        parts = urlsplit(url)
        if not parts.password:
            return url
        netloc = parts.netloc.rsplit("@", 1)[1]
        user = parts.username or ""
        return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))
    except ValueError:
        return "<unparsable Redis URL>"


def is_timeout(error: BaseException) -> bool:
    return isinstance(error, (TimeoutError, redis.TimeoutError))


def check_url(url: object, cluster: bool) -> None:
    if not isinstance(url, str):
        raise ConfigError(f"Redis URL must be a string, got {type(url).__name__}")
    shown = redact_url(url)
    try:
        options = parse_url(url)
    except ValueError as e:
        raise ConfigError(f"bad Redis URL {shown!r}: {e}") from None
    if cluster and "path" in options:
        raise ConfigError(f"bad Redis URL {shown!r}: a cluster needs redis:// or rediss://")
    if "path" not in options and not options.get("host"):
        raise ConfigError(f"bad Redis URL {shown!r}: no host")
    if "path" not in options and not re.fullmatch(r"/?\d*", urlsplit(url).path):
        raise ConfigError(f"bad Redis URL {shown!r}: the path must be a database number")


def _positive(value: object, kind: type | tuple[type, ...] = (int, float)) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool) and value > 0  # type: ignore[operator]


def check_args(
    capacity_bytes: int,
    ttl_s: float | None,
    num_connections: int,
    key_prefix: str,
    timeout_s: float,
    name: str,
) -> None:
    few = _positive(num_connections, int) and num_connections <= 64
    short = isinstance(key_prefix, str) and 0 < len(key_prefix) <= 256
    checks = [
        ("capacity_bytes", capacity_bytes, _positive(capacity_bytes, int), "a positive int"),
        ("ttl_s", ttl_s, ttl_s is None or _positive(ttl_s), "None or > 0"),
        ("num_connections", num_connections, few, "an int in [1, 64]"),
        ("key_prefix", key_prefix, short, "a non-empty str of at most 256 chars"),
        ("timeout_s", timeout_s, _positive(timeout_s), "> 0"),
        ("name", name, isinstance(name, str) and bool(name), "a non-empty str"),
    ]
    for field, value, ok, requirement in checks:
        if not ok:
            raise ConfigError(f"RedisTier {field} must be {requirement}, got {value!r:.80}")

"""The project's exception tree.

Tiers and transports convert third-party errors (OS, redis, grpc) into these at their edge;
``server/`` alone maps them to gRPC status codes and HTTP statuses (``server/status.py``).
A normal miss or "no room" is not an error: those return ``None`` or a count.
"""

from __future__ import annotations


class LMCacheSvcError(Exception):
    """Base of every error this project raises on purpose."""

    kind = "internal"


class InvalidArgument(LMCacheSvcError):
    """The caller sent something malformed: a bad key, size, field or config value."""

    kind = "invalid_argument"


class UnknownNamespace(InvalidArgument):
    """A namespace id that was never registered with this server."""

    kind = "unknown_namespace"


class SizeMismatch(InvalidArgument):
    """Chunk bytes whose length disagrees with the namespace's chunk size."""

    kind = "size_mismatch"


class PayloadTooLarge(InvalidArgument):
    """A body or batch over the configured limit."""

    kind = "payload_too_large"


class BodyTimeout(InvalidArgument):
    """A request body that stopped arriving (the client stalled or sends too slowly)."""

    kind = "request_timeout"


class BadMemory(InvalidArgument):
    """A memory body that is not a memory blob: not safetensors, or bad header metadata."""

    kind = "bad_memory"


class Conflict(LMCacheSvcError):
    """A named object already exists with other contents (a memory id stored with other
    bytes)."""

    kind = "conflict"


class NotFound(LMCacheSvcError):
    """A named object (chunk, lease, reservation) that does not exist (any more)."""

    kind = "not_found"


class UnknownSession(NotFound):
    """A session id the server does not know (it restarted, or the session ended)."""

    kind = "unknown_session"


class ReservationExpired(NotFound):
    """A store reservation passed its deadline before it was committed: nothing was stored."""

    kind = "reservation_expired"


class NoSpace(LMCacheSvcError):
    """No tier could make room without evicting pinned data."""

    kind = "no_space"


class TooManyNamespaces(LMCacheSvcError):
    """The server holds ``cache.max_namespaces`` namespaces already; a new one is refused."""

    kind = "too_many_namespaces"


class ReservationLimit(NoSpace):
    """One owner (session or upload), or one tenant, already holds its share of the first
    tier reserved."""

    kind = "reservation_limit"


class LeaseLimit(NoSpace):
    """One tenant already holds its share of load leases (count or leased chunks)."""

    kind = "lease_limit"


class Unauthenticated(LMCacheSvcError):
    """Missing or wrong credentials."""

    kind = "unauthenticated"


class PermissionDenied(LMCacheSvcError):
    """Valid credentials that do not allow this call (another tenant, admin-only, read-only)."""

    kind = "permission_denied"


class ConfigError(LMCacheSvcError):
    """Invalid configuration, detected at start-up."""

    kind = "config"


class TierError(LMCacheSvcError):
    """A tier's backend failed (disk I/O error, Redis down): the data is unavailable."""

    kind = "tier_unavailable"


class Corrupted(TierError):
    """Stored bytes failed their checksum or header check; the chunk was dropped."""

    kind = "corrupted"


class MemoryCorrupted(Corrupted):
    """A stored memory whose bytes differ from the checksum recorded when it was stored: it
    is not served, and its file is moved aside (quarantined)."""

    kind = "memory_corrupted"


class TooBusy(LMCacheSvcError):
    """The server already runs as many transfers of this kind as it allows; retry later."""

    kind = "too_busy"


class ServerUnavailable(LMCacheSvcError):
    """Client side: the server could not be reached or did not answer in time."""

    kind = "server_unavailable"

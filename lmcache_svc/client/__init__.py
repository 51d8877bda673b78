"""The Python client of the cache server (needs only grpcio, protobuf and numpy).

``cache_client.py`` holds ``CacheClient``, built on ``channel.py`` (the channel, stubs and
how a call is made) and ``memories.py`` (the named-memory calls); ``session.py`` the session
stream and what it mapped; ``lookup_reports.py`` the count of lookups answered from the
lookup index, reported to the server; ``transport.py`` the gRPC plumbing (targets, channel
options, error conversion, inline streams, the shared segment's slots and leases);
``defaults.py`` the socket path both sides use unless told otherwise.
"""

from __future__ import annotations

from lmcache_svc.client.cache_client import CacheClient
from lmcache_svc.client.transport import LoadLease, StoreSlot, default_address
from lmcache_svc.memory_blob import MemoryInfo
from lmcache_svc.results import LookupResult, StoreStatus

__all__ = [
    "CacheClient",
    "LoadLease",
    "LookupResult",
    "MemoryInfo",
    "StoreSlot",
    "StoreStatus",
    "default_address",
]

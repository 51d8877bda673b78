"""The Python client of the cache server (needs only grpcio, protobuf and numpy).

``cache_client.py`` holds ``CacheClient``; ``transport.py`` the gRPC plumbing it uses (targets,
channel options, error conversion, inline streams, the shared segment's slots and leases);
``defaults.py`` the socket path both sides use unless told otherwise.
"""

from __future__ import annotations

from lmcache_svc.client.cache_client import CacheClient
from lmcache_svc.client.transport import LoadLease, StoreSlot, default_address
from lmcache_svc.memories.format import MemoryInfo
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

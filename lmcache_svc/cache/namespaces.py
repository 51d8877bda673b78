"""The namespaces a cache knows: registration (bounded by ``cache.max_namespaces``), the
checks every request makes (a registered namespace, a bounded batch) and its chunk keys.

Locking: ``register`` changes the table under the cache's lock (passed in) and tells the
lookup-index publisher and the listener under it (both quick, neither calls back into the
cache); reads need no lock (a namespace, once registered, is never removed).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmcache_svc.cache.listener import ChunkListener
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.errors import InvalidArgument, PayloadTooLarge, TooManyNamespaces, UnknownNamespace
from lmcache_svc.keys import ChunkKey, Namespace, NamespaceId, check_namespace_id, make_chunk_keys

if TYPE_CHECKING:
    from lmcache_svc.server.events.meta import ChunkMeta
    from lmcache_svc.server.index_publisher import IndexPublisher


class Namespaces:
    def __init__(
        self,
        lock: threading.RLock,
        settings: CacheSettings,
        lookup_index: IndexPublisher | None,
        listener: ChunkListener | None,
    ) -> None:
        self._lock = lock
        self._settings = settings
        self._lookup_index = lookup_index
        self._listener = listener
        self._known: dict[NamespaceId, Namespace] = {}

    def __len__(self) -> int:
        return len(self._known)

    def register(self, namespace: Namespace) -> Namespace:
        """Register (or find again) a namespace; ``TooManyNamespaces`` past the limit."""
        limit = self._settings.max_chunk_bytes
        if namespace.chunk_bytes > limit:
            raise InvalidArgument(
                f"namespace chunk_bytes is {namespace.chunk_bytes}, over this server's "
                f"max_body_bytes ({limit}): use a smaller chunk_size"
            )
        with self._lock:
            known = self._known.get(namespace.namespace_id)
            if known is not None:
                return known
            if len(self._known) >= self._settings.max_namespaces:
                raise TooManyNamespaces(
                    f"this server holds {len(self._known)} namespaces, its limit "
                    "(cache.max_namespaces); registered ones keep working"
                )
            self._known[namespace.namespace_id] = namespace
            if self._lookup_index is not None:
                self._lookup_index.add_namespace(namespace)
            if self._listener is not None:
                self._listener.namespace_registered(namespace)
            return namespace

    def get(self, namespace_id: bytes) -> Namespace:
        """The registered namespace; ``UnknownNamespace`` otherwise."""
        ns_id = check_namespace_id(namespace_id)
        try:
            return self._known[ns_id]
        except KeyError:
            raise UnknownNamespace(
                f"namespace {ns_id.hex()} is not registered; register it first"
            ) from None

    def check_batch(self, namespace_id: bytes, num_chunks: int) -> Namespace:
        """The registered namespace of a request for ``num_chunks`` chunks, once that count
        is within ``max_chunks_per_request`` (``PayloadTooLarge`` otherwise)."""
        if num_chunks > self._settings.max_chunks_per_request:
            raise PayloadTooLarge(
                f"{num_chunks} chunks in one request; the limit is "
                f"{self._settings.max_chunks_per_request}"
            )
        return self.get(namespace_id)

    def keys(self, namespace_id: bytes, chunk_hashes: Sequence[bytes]) -> list[ChunkKey]:
        """The chunk keys of a checked request."""
        ns = self.check_batch(namespace_id, len(chunk_hashes))
        return make_chunk_keys(ns.namespace_id, chunk_hashes)

    def describe(
        self,
        namespace_id: bytes,
        keys: Sequence[ChunkKey],
        chunk_hashes: Sequence[bytes],
        token_ids: bytes,
        parent_hashes: Sequence[bytes],
    ) -> dict[ChunkKey, ChunkMeta] | None:
        """The chunks' token ids and parents for the listener (checked against their
        hashes), or None when nobody listens or the request carries none."""
        if self._listener is None or not token_ids:
            return None
        from lmcache_svc.server.events.meta import describe_chunks

        ns = self.get(namespace_id)
        return dict(zip(keys, describe_chunks(ns, chunk_hashes, token_ids, parent_hashes)))

"""Store-pool placeholders: committing slots reserved ahead under placeholder hashes.

A client's store pool (``lmcache_svc/client/store_pool.py``) reserves slots under random
placeholder chunk hashes before it knows what it will write; ``bind_store`` then commits
each written slot under the chunk it now holds (docs/architecture.md, "Policy": "Slots
reserved ahead").
"""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_svc.cache.core import CacheCore
from lmcache_svc.cache.stores import StorePath
from lmcache_svc.errors import InvalidArgument
from lmcache_svc.keys import ChunkKey


class PlaceholderBinding:
    def __init__(self, core: CacheCore, stores: StorePath) -> None:
        self._core = core
        self._stores = stores

    def bind_store(
        self,
        namespace_id: bytes,
        chunk_hashes: Sequence[bytes],
        reserved_as: Sequence[bytes],
        *,
        session_id: str | None = None,
        token_ids: bytes = b"",
        parent_hashes: Sequence[bytes] = (),
    ) -> tuple[int, list[bytes]]:
        """Commit pooled reservations under the chunks written into them: the slot reserved
        for placeholder ``reserved_as[i]`` becomes chunk ``chunk_hashes[i]``. Returns (chunks
        committed, placeholders still reserved): a placeholder whose chunk is stored or being
        stored already stays its owner's, to be written again; one that is not the caller's
        live reservation (expired, aborted, another session's) publishes nothing."""
        if len(reserved_as) != len(chunk_hashes):
            raise InvalidArgument(
                f"{len(chunk_hashes)} chunk hashes but {len(reserved_as)} reserved_as hashes"
            )
        core = self._core
        namespaces, slots = core.namespaces, core.slots
        keys = namespaces.keys(namespace_id, chunk_hashes)
        metas = namespaces.describe(namespace_id, keys, chunk_hashes, token_ids, parent_hashes)
        placeholders = namespaces.keys(namespace_id, reserved_as)
        bound: list[ChunkKey] = []
        kept: list[bytes] = []
        with core.lock:
            for key, placeholder, raw in zip(keys, placeholders, reserved_as):
                if slots.live_reservation(placeholder, session_id) is None:
                    continue
                if slots.busy(key) or core.lower.local_tier(key) is not None:
                    kept.append(bytes(raw))
                    continue
                slots.rekey(placeholder, key)
                bound.append(key)
            # under the same hold: the reaper cannot expire a rekeyed reservation before
            # its commit (it would stay quarantined under the chunk's own key)
            return self._stores.commit_keys(bound, session_id, metas), kept

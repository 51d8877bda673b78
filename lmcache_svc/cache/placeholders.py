"""Store-pool placeholders: committing slots reserved ahead under placeholder hashes.

A client's store pool (``lmcache_svc/client/store_pool.py``) reserves slots under random
placeholder chunk hashes before it knows what it will write; ``bind_store`` then commits
each written slot under the chunk it now holds (docs/architecture.md, "Policy": "Slots
reserved ahead").
"""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_svc.cache.stores import StorePath
from lmcache_svc.errors import InvalidArgument
from lmcache_svc.keys import ChunkKey


class PlaceholderBinding(StorePath):
    def bind_store(
        self,
        namespace_id: bytes,
        chunk_hashes: Sequence[bytes],
        reserved_as: Sequence[bytes],
        *,
        session_id: str | None = None,
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
        keys = self._keys(namespace_id, chunk_hashes)
        placeholders = self._keys(namespace_id, reserved_as)
        bound: list[ChunkKey] = []
        kept: list[bytes] = []
        with self._lock:
            for key, placeholder, raw in zip(keys, placeholders, reserved_as):
                if self._live_reservation(placeholder, session_id) is None:
                    continue
                if self._index.busy(key) or self._lower.local_tier(key) is not None:
                    kept.append(bytes(raw))
                    continue
                self._first_tier.rekey(placeholder, key)
                bound.append(key)
            # under the same hold: the reaper cannot expire a rekeyed reservation before
            # its commit (it would stay quarantined under the chunk's own key)
            return self._commit_keys(bound, session_id), kept

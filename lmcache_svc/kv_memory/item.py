"""``KVCacheItem``: one named KV memory (a UUID, a transformers ``DynamicCache``, metadata).

Field names follow MemOS's documentation (``kv_cache_id``, ``kv_cache``, ``metadata``);
MemOS's current names ``id`` and ``memory`` are aliases of the first two, so code written
for either works. ``token_ids`` are the tokens the cache was computed from and ``model`` the
identity of the model that computed it (both set by ``KVCacheMemory.extract``). ``records``
mirrors MemOS's ``KVCacheRecords`` as a dict, for code that reads it; it is not stored.
"""

from __future__ import annotations

import uuid
from typing import Any


def new_memory_id() -> str:
    return str(uuid.uuid4())


def canonical_memory_id(memory_id: str) -> str:
    """The lowercase 8-4-4-4-12 form; ``ValueError`` for anything that is not a UUID."""
    return str(uuid.UUID(str(memory_id)))


class KVCacheItem:
    __slots__ = ("kv_cache", "kv_cache_id", "metadata", "token_ids", "model", "records")

    def __init__(
        self,
        kv_cache: Any = None,
        kv_cache_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        token_ids: list[int] | None = None,
        model: str | None = None,
        *,
        id: str | None = None,  # noqa: A002 - MemOS's name
        memory: Any = None,
    ) -> None:
        if kv_cache is not None and memory is not None:
            raise TypeError("give kv_cache or its alias memory, not both")
        if kv_cache_id is not None and id is not None:
            raise TypeError("give kv_cache_id or its alias id, not both")
        self.kv_cache = kv_cache if kv_cache is not None else memory
        raw_id = kv_cache_id if kv_cache_id is not None else id
        self.kv_cache_id = canonical_memory_id(raw_id) if raw_id is not None else new_memory_id()
        self.metadata = dict(metadata or {})
        self.token_ids = list(token_ids) if token_ids is not None else None
        self.model = model
        # MemOS's KVCacheRecords, kept for code that reads it; not stored in the service.
        self.records: dict[str, Any] = {"text_memories": [], "composed_text_memory": ""}

    @property
    def id(self) -> str:  # noqa: A003 - MemOS's name
        return self.kv_cache_id

    @id.setter
    def id(self, value: str) -> None:  # noqa: A003
        self.kv_cache_id = canonical_memory_id(value)

    @property
    def memory(self) -> Any:
        return self.kv_cache

    @memory.setter
    def memory(self, value: Any) -> None:
        self.kv_cache = value

    def __repr__(self) -> str:
        return (
            f"KVCacheItem(kv_cache_id={self.kv_cache_id!r}, model={self.model!r}, "
            f"num_tokens={None if self.token_ids is None else len(self.token_ids)})"
        )

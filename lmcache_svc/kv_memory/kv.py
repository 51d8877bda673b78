"""``KVCacheMemory``: MemOS's activation-memory API over memories kept in the service.

Semantics follow MemOS's ``KVCacheMemory`` (``extract`` does not add; ``get_by_ids`` keeps
order with ``None`` for misses; ``get_cache`` merges in id order, skips misses, returns
``None`` when nothing is left; ``delete`` ignores misses). Differences, on purpose:
everything returned is a new object (generation never changes a stored memory); merging
re-rotates keys to their merged positions and checks the caches agree; ``dump``/``load``
use safetensors, refuse pickles and other models' memories, and change nothing on error.
The memories are those of the backend (the service: shared by every process using it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from transformers import DynamicCache

from lmcache_svc.errors import Conflict, InvalidArgument
from lmcache_svc.kv_memory.backend import InProcessBackend, MemoryBackend, service_backend
from lmcache_svc.kv_memory.blob import item_from_blob, item_to_blob
from lmcache_svc.kv_memory.cache_layers import cache_layers, seq_len, shape_of
from lmcache_svc.kv_memory.config import KVCacheMemoryConfig
from lmcache_svc.kv_memory.dumpfile import read_dump, write_dump
from lmcache_svc.kv_memory.item import KVCacheItem, canonical_memory_id
from lmcache_svc.kv_memory.merge import check_agreement, merge_caches
from lmcache_svc.kv_memory.model import Generation, LocalModel, Source
from lmcache_svc.kv_memory.rope import rope_of


class KVCacheMemory:
    def __init__(
        self,
        config: KVCacheMemoryConfig,
        *,
        backend: MemoryBackend | None = None,
        model: LocalModel | None = None,
    ) -> None:
        self.config = config
        hf = config.extractor_llm.config
        self.llm = model or LocalModel(hf.model_name_or_path, hf.add_generation_prompt)
        if backend is None and config.service_address:
            backend = service_backend(config.service_address, config.auth_token, config.tenant)
        self.backend: MemoryBackend = backend or InProcessBackend()

    def close(self) -> None:
        """Close the connection to the service (if any)."""
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> KVCacheMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- building -----------------------------------------------------------------------

    def extract(self, text: Source) -> KVCacheItem:
        """Run the model over ``text`` (see ``model.py`` for the encoding rule); not added."""
        ids = self.llm.memory_ids(text)
        return KVCacheItem(
            kv_cache=self.llm.prefill(ids),
            metadata={"source_text": _jsonable(text), "extracted_at": _now()},
            token_ids=ids,
            model=self.llm.identity,
        )

    def from_textual_memory(self, mem: Any) -> KVCacheItem:
        """An item from a MemOS ``TextualMemoryItem`` (its ``memory`` text and metadata)."""
        item = self.extract(str(mem.memory))
        metadata: Any = getattr(mem, "metadata", None)
        if metadata is not None and hasattr(metadata, "model_dump"):
            metadata = metadata.model_dump()
        item.metadata = {**_jsonable(metadata or {}), "source_text": str(mem.memory)}
        return item

    # -- storing ------------------------------------------------------------------------

    def add(self, memories: Sequence[KVCacheItem]) -> None:
        """Store the items (an id already stored is replaced). Checked before any is stored."""
        blobs = [item_to_blob(self._checked(item)) for item in memories]
        for blob, item in zip(blobs, memories):
            self._put(blob, item.kv_cache_id)

    def _checked(self, item: KVCacheItem) -> KVCacheItem:
        if not isinstance(item, KVCacheItem):
            raise InvalidArgument(f"add() takes KVCacheItems, got {type(item).__name__}")
        layers = cache_layers(item.kv_cache)
        if item.token_ids is not None and len(item.token_ids) != seq_len(layers):
            raise InvalidArgument(
                f"memory {item.kv_cache_id}: {len(item.token_ids)} token ids for a cache of "
                f"{seq_len(layers)} tokens"
            )
        try:
            json.dumps(item.metadata)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(
                f"memory {item.kv_cache_id}: metadata is not JSON: {exc}"
            ) from None
        if item.model is None:
            self._check_fits_model(item)
            item.model = self.llm.identity
        return item

    def _check_fits_model(self, item: KVCacheItem) -> None:
        cfg = self.llm.model.config
        shape = shape_of(cache_layers(item.kv_cache))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        expected = (cfg.num_hidden_layers, kv_heads, head_dim)
        if (shape.num_layers, shape.num_kv_heads, shape.head_dim) != expected:
            raise InvalidArgument(
                f"memory {item.kv_cache_id} has no model identity and its cache "
                f"({shape.describe()}) does not fit this model ({expected[0]} layers, "
                f"{expected[1]} KV heads, head size {expected[2]})"
            )

    def _put(self, blob: bytes, memory_id: str) -> None:
        try:
            self.backend.put_memory(blob)
        except Conflict:
            self.backend.delete_memory(memory_id)
            self.backend.put_memory(blob)

    # -- reading (always new objects) ----------------------------------------------------

    def get(self, memory_id: str) -> KVCacheItem | None:
        try:
            memory_id = canonical_memory_id(memory_id)
        except ValueError:
            return None
        blob = self.backend.get_memory(memory_id)
        return None if blob is None else item_from_blob(blob)

    def get_by_ids(self, memory_ids: Sequence[str]) -> list[KVCacheItem | None]:
        return [self.get(memory_id) for memory_id in memory_ids]

    def get_all(self) -> list[KVCacheItem]:
        infos = self.backend.list_memories()
        found = (self.get(info.memory_id) for info in infos)
        return [item for item in found if item is not None]

    def get_cache(self, cache_ids: Sequence[str], *, rerotate: bool = True) -> DynamicCache | None:
        """The memories' caches merged in id order (missing ids skipped), or ``None``.

        Keys of the second and later memories are re-rotated to their merged positions
        (``rerotate=False`` gives MemOS's plain concatenation, for comparison only).
        """
        items = self._present(cache_ids)
        return None if not items else self._merge(items, rerotate)

    def _present(self, cache_ids: Iterable[str]) -> list[KVCacheItem]:
        return [item for item in self.get_by_ids(list(cache_ids)) if item is not None]

    def _merge(self, items: Sequence[KVCacheItem], rerotate: bool) -> DynamicCache:
        check_agreement(items, self.llm.identity)
        rope = rope_of(self.llm.model) if rerotate and len(items) > 1 else None
        return merge_caches(items, rope)

    # -- deleting -----------------------------------------------------------------------

    def delete(self, memory_ids: Sequence[str]) -> None:
        for memory_id in memory_ids:
            try:
                self.backend.delete_memory(canonical_memory_id(memory_id))
            except ValueError:
                continue

    def delete_all(self) -> None:
        """Delete every memory of the backend (in the service: all of this tenant's)."""
        for info in self.backend.list_memories():
            self.backend.delete_memory(info.memory_id)

    # -- files --------------------------------------------------------------------------

    def dump(self, dir: str) -> None:  # noqa: A002 - MemOS's name
        """Write every memory to ``dir/<memory_filename>`` (safetensors, replaced atomically)."""
        os.makedirs(dir, exist_ok=True)
        path = os.path.join(dir, self.config.memory_filename)
        write_dump(path, self.get_all(), self.llm.identity)

    def load(self, dir: str) -> None:  # noqa: A002 - MemOS's name
        """Replace the memories with those of ``dir/<memory_filename>``.

        The whole file is read and checked first: a pickle, a malformed file or another
        model's memories raise ``InvalidArgument`` and leave the memories as they were.
        """
        path = os.path.join(dir, self.config.memory_filename)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no memory dump at {path}")
        items = read_dump(path, self.llm.identity)
        keep = {item.kv_cache_id for item in items}
        before = {info.memory_id for info in self.backend.list_memories()}
        saved = {i: self.backend.get_memory(i) for i in keep & before}
        try:
            self.add(items)
        except Exception:
            self._restore(keep - before, saved)
            raise
        self.delete([memory_id for memory_id in before if memory_id not in keep])

    def _restore(self, added: set[str], saved: dict[str, bytes | None]) -> None:
        """Undo a failed load's puts: drop the new ids, put back the replaced blobs."""
        for memory_id in added | set(saved):
            self.backend.delete_memory(memory_id)
        for blob in saved.values():
            if blob is not None:
                self.backend.put_memory(blob)

    # -- generation (same encoding rule as extract) -------------------------------------

    def prompt_ids(self, query: Source, memory_ids: Sequence[str] = ()) -> list[int]:
        """The token sequence of ``memory_ids``' texts then ``query``: the prompt path."""
        ids: list[int] = []
        for item in self._present(memory_ids):
            if item.token_ids is None:
                raise InvalidArgument(f"memory {item.kv_cache_id} has no token ids")
            ids.extend(item.token_ids)
        return ids + self.llm.query_ids(query)

    def generate_ids(
        self,
        query: Source,
        memory_ids: Sequence[str] = (),
        *,
        inject: bool = True,
        max_new_tokens: int | None = None,
    ) -> Generation:
        """Greedy generation after the memories and ``query``: with the memories' caches
        injected (``inject=True``) or with their texts as part of the prompt."""
        limit = max_new_tokens or self.config.extractor_llm.config.max_tokens
        items = self._present(memory_ids)
        ids = self.prompt_ids(query, [item.kv_cache_id for item in items])
        past = self._merge(items, True) if inject and items else None
        return self.llm.generate(ids, past, limit)

    def generate(self, query: Source, memory_ids: Sequence[str] = (), **kw: Any) -> str:
        return self.llm.decode(self.generate_ids(query, memory_ids, **kw).token_ids)

    def build_vllm_kv_cache(
        self, messages: Source, prefill: Callable[[list[int]], object]
    ) -> list[int]:
        """Put the KV of ``messages`` into the service through a vLLM engine; their token ids.

        ``messages`` are encoded by the chat-template rule (as ``extract`` encodes a memory)
        and handed to ``prefill``, which must run them as a prompt (one generated token is
        enough) through a vLLM engine that uses the lmcache-svc connector, e.g. ``lambda ids:
        llm.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=1))``.
        The connector stores their chunks in the service; a later request in any engine with
        the connector whose prompt starts with these ids (``vllm_prompt_ids``) loads that
        prefix, chunk-aligned, instead of computing it.
        """
        ids = self.llm.memory_ids(messages)
        prefill(ids)
        return ids

    def vllm_prompt_ids(self, messages: Source, query: Source) -> list[int]:
        """The prompt for a request after ``build_vllm_kv_cache(messages)``: same rule."""
        return self.llm.memory_ids(messages) + self.llm.query_ids(query)


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))

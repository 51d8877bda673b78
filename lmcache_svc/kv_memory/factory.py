"""MemOS's ``MemoryFactory.from_config`` for the ``kv_cache`` backend."""

from __future__ import annotations

from lmcache_svc.kv_memory.config import MemoryConfigFactory
from lmcache_svc.kv_memory.kv import KVCacheMemory


class MemoryFactory:
    @staticmethod
    def from_config(config: MemoryConfigFactory) -> KVCacheMemory:
        return KVCacheMemory(config.config)

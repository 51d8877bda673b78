"""MemOS-compatible named KV memories whose storage is the lmcache-svc service.

Needs the ``memory`` extra (transformers, safetensors) and torch; the server never imports
this package. See docs/memories.md.
"""

from __future__ import annotations

from lmcache_svc.kv_memory.backend import InProcessBackend, MemoryBackend
from lmcache_svc.kv_memory.config import KVCacheMemoryConfig, MemoryConfigFactory
from lmcache_svc.kv_memory.factory import MemoryFactory
from lmcache_svc.kv_memory.item import KVCacheItem
from lmcache_svc.kv_memory.kv import KVCacheMemory

__all__ = [
    "InProcessBackend",
    "KVCacheItem",
    "KVCacheMemory",
    "KVCacheMemoryConfig",
    "MemoryBackend",
    "MemoryConfigFactory",
    "MemoryFactory",
]

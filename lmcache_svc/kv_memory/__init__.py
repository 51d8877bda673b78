"""The client API of named KV memories, MemOS-compatible (``KVCacheMemory``), whose storage
is the lmcache-svc service (the server keeps them in ``lmcache_svc.server.memories``).

Needs the ``memory`` extra (transformers, safetensors) and torch, unlike the rest of the
client side (``lmcache_svc.client``); the server never imports this package. See
docs/memories.md.
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

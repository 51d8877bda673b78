"""The tiered cache: ``TieredCache`` and the parts it is made of (docs/architecture.md,
"The cache package")."""

from __future__ import annotations

from lmcache_svc.cache.tiered_cache import TieredCache

__all__ = ["TieredCache"]

"""lmcache-svc: a standalone KV-cache service for LLM inference engines."""

__version__ = "0.1.0"

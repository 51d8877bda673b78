"""Named KV memories kept by the service: the blob format check (``format``) and the
tenant-scoped store with its capacity and persistence (``store``). The user-facing API that
builds and reads these blobs is ``lmcache_svc.kv_memory``; the contract between the two is in
``docs/memories.md``."""

"""Named KV memories kept by the service: the blob format check (``format``), the
tenant-scoped store with its capacity and persistence (``store``), where blobs live
(``blobs``: RAM or a directory, ``scan``: what a restart finds there), the checksums that keep
a memory's served bytes its stored bytes (``integrity``) and the cap on transfers in flight
(``transfers``). The user-facing API that builds and reads these blobs is
``lmcache_svc.kv_memory``; the contract between the two is in ``docs/memories.md``."""

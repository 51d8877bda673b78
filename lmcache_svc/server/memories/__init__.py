"""The server's store of named KV memories: tenant-scoped, capacity-bounded, optionally
persistent (``store``), over blobs kept in RAM or in a directory (``blobs``: RAM or a
directory, ``scan``: what a restart finds there), the checksums that keep a memory's served
bytes its stored bytes (``integrity``) and the cap on transfers in flight (``transfers``).
What a blob must be is ``lmcache_svc.memory_blob``, which the client side shares; the client
API that builds and reads these blobs is ``lmcache_svc.kv_memory``; the contract between the
two is in ``docs/memories.md``."""

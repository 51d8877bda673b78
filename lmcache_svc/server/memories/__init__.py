"""The server's store of named KV memories: tenant-scoped, capacity-bounded, optionally
persistent (``store``), over blobs kept in RAM or in a directory (``blobs``). What a blob
must be is ``lmcache_svc.memory_blob``, which the client side shares; the client API that
builds and reads these blobs is ``lmcache_svc.kv_memory``; the contract between the two is
in ``docs/memories.md``."""

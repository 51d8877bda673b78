"""The gRPC transport, thin adapters to cache calls: ``cache_service`` (CacheService
and the grpc.aio server), ``memory_service`` (MemoryService), ``inline`` (the Put/Get
streams), ``auth`` (the interceptor: who calls, what it may touch), ``calls`` (how every
handler ends a call), ``index_segments`` (the lookup-index tables a session gets).
"""

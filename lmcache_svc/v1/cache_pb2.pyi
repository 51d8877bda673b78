from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Medium(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEDIUM_UNSPECIFIED: _ClassVar[Medium]
    MEDIUM_HOST_MEMORY: _ClassVar[Medium]
    MEDIUM_DEVICE: _ClassVar[Medium]
    MEDIUM_DISK: _ClassVar[Medium]
    MEDIUM_REMOTE: _ClassVar[Medium]

class StoreStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORE_STATUS_UNSPECIFIED: _ClassVar[StoreStatus]
    RESERVED: _ClassVar[StoreStatus]
    ALREADY_STORED: _ClassVar[StoreStatus]
    NO_SPACE: _ClassVar[StoreStatus]
    IN_PROGRESS: _ClassVar[StoreStatus]
MEDIUM_UNSPECIFIED: Medium
MEDIUM_HOST_MEMORY: Medium
MEDIUM_DEVICE: Medium
MEDIUM_DISK: Medium
MEDIUM_REMOTE: Medium
STORE_STATUS_UNSPECIFIED: StoreStatus
RESERVED: StoreStatus
ALREADY_STORED: StoreStatus
NO_SPACE: StoreStatus
IN_PROGRESS: StoreStatus

class KVLayout(_message.Message):
    __slots__ = ("dtype", "num_layers", "num_kv_heads", "head_size", "block_size", "page_layout", "kv_planes")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_PLANES_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    page_layout: str
    kv_planes: int
    def __init__(self, dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., block_size: _Optional[int] = ..., page_layout: _Optional[str] = ..., kv_planes: _Optional[int] = ...) -> None: ...

class Namespace(_message.Message):
    __slots__ = ("model", "layout", "chunk_size", "tp_rank", "tp_size", "tenant", "key_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEY_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    layout: KVLayout
    chunk_size: int
    tp_rank: int
    tp_size: int
    tenant: str
    key_version: int
    def __init__(self, model: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., chunk_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., tenant: _Optional[str] = ..., key_version: _Optional[int] = ...) -> None: ...

class RegisterNamespaceRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ...) -> None: ...

class RegisterNamespaceResponse(_message.Message):
    __slots__ = ("namespace_id", "chunk_bytes", "events_topic", "events_endpoint", "events_replay_endpoint")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_TOPIC_FIELD_NUMBER: _ClassVar[int]
    EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    chunk_bytes: int
    events_topic: str
    events_endpoint: str
    events_replay_endpoint: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., chunk_bytes: _Optional[int] = ..., events_topic: _Optional[str] = ..., events_endpoint: _Optional[str] = ..., events_replay_endpoint: _Optional[str] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("transport", "name", "size", "nonce")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    transport: str
    name: str
    size: int
    nonce: bytes
    def __init__(self, transport: _Optional[str] = ..., name: _Optional[str] = ..., size: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("client_name",)
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    def __init__(self, client_name: _Optional[str] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("session_id", "segments")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, session_id: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace_id", "chunk_hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    chunk_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., chunk_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_hit_chunks", "tiers", "media")
    NUM_HIT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    num_hit_chunks: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    media: _containers.RepeatedScalarFieldContainer[Medium]
    def __init__(self, num_hit_chunks: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ..., media: _Optional[_Iterable[_Union[Medium, str]]] = ...) -> None: ...

class ReportLookupsRequest(_message.Message):
    __slots__ = ("namespace_id", "num_lookups", "num_chunks", "num_hit_chunks")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HIT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    num_lookups: int
    num_chunks: int
    num_hit_chunks: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., num_lookups: _Optional[int] = ..., num_chunks: _Optional[int] = ..., num_hit_chunks: _Optional[int] = ...) -> None: ...

class ReportLookupsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrepareStoreRequest(_message.Message):
    __slots__ = ("namespace_id", "chunk_hashes", "session_id", "ttl_ms")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    chunk_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    session_id: str
    ttl_ms: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., chunk_hashes: _Optional[_Iterable[bytes]] = ..., session_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class PreparedSlot(_message.Message):
    __slots__ = ("chunk_hash", "status", "offset", "length")
    CHUNK_HASH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    chunk_hash: bytes
    status: StoreStatus
    offset: int
    length: int
    def __init__(self, chunk_hash: _Optional[bytes] = ..., status: _Optional[_Union[StoreStatus, str]] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class PrepareStoreResponse(_message.Message):
    __slots__ = ("slots", "segment_name")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_NAME_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[PreparedSlot]
    segment_name: str
    def __init__(self, slots: _Optional[_Iterable[_Union[PreparedSlot, _Mapping]]] = ..., segment_name: _Optional[str] = ...) -> None: ...

class CommitStoreRequest(_message.Message):
    __slots__ = ("namespace_id", "chunk_hashes", "session_id", "abort", "reserved_as", "token_ids", "parent_hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    RESERVED_AS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    chunk_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    session_id: str
    abort: bool
    reserved_as: _containers.RepeatedScalarFieldContainer[bytes]
    token_ids: bytes
    parent_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., chunk_hashes: _Optional[_Iterable[bytes]] = ..., session_id: _Optional[str] = ..., abort: _Optional[bool] = ..., reserved_as: _Optional[_Iterable[bytes]] = ..., token_ids: _Optional[bytes] = ..., parent_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CommitStoreResponse(_message.Message):
    __slots__ = ("num_committed", "kept")
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    num_committed: int
    kept: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, num_committed: _Optional[int] = ..., kept: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrepareLoadRequest(_message.Message):
    __slots__ = ("namespace_id", "chunk_hashes", "session_id", "ttl_ms", "verify")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    chunk_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    session_id: str
    ttl_ms: int
    verify: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., chunk_hashes: _Optional[_Iterable[bytes]] = ..., session_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., verify: _Optional[bool] = ...) -> None: ...

class SlotRef(_message.Message):
    __slots__ = ("chunk_hash", "offset", "length")
    CHUNK_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    chunk_hash: bytes
    offset: int
    length: int
    def __init__(self, chunk_hash: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class PrepareLoadResponse(_message.Message):
    __slots__ = ("lease_id", "slots", "segment_name")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_NAME_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    slots: _containers.RepeatedCompositeFieldContainer[SlotRef]
    segment_name: str
    def __init__(self, lease_id: _Optional[str] = ..., slots: _Optional[_Iterable[_Union[SlotRef, _Mapping]]] = ..., segment_name: _Optional[str] = ...) -> None: ...

class ReleaseLoadRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseLoadResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class TouchChunksRequest(_message.Message):
    __slots__ = ("namespace_id", "chunk_hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    chunk_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., chunk_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TouchChunksResponse(_message.Message):
    __slots__ = ("num_touched",)
    NUM_TOUCHED_FIELD_NUMBER: _ClassVar[int]
    num_touched: int
    def __init__(self, num_touched: _Optional[int] = ...) -> None: ...

class ChunkHeader(_message.Message):
    __slots__ = ("namespace_id", "chunk_hash", "length", "found", "tier", "token_ids", "parent_hash")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    chunk_hash: bytes
    length: int
    found: bool
    tier: str
    token_ids: bytes
    parent_hash: bytes
    def __init__(self, namespace_id: _Optional[bytes] = ..., chunk_hash: _Optional[bytes] = ..., length: _Optional[int] = ..., found: _Optional[bool] = ..., tier: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ...) -> None: ...

class ChunkPart(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_stored", "num_no_space", "num_in_progress")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_NO_SPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_no_space: int
    num_in_progress: int
    def __init__(self, num_stored: _Optional[int] = ..., num_no_space: _Optional[int] = ..., num_in_progress: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace_id", "chunk_hashes", "verify")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    chunk_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    verify: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., chunk_hashes: _Optional[_Iterable[bytes]] = ..., verify: _Optional[bool] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace_id", "chunk_hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    chunk_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., chunk_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("num_deleted",)
    NUM_DELETED_FIELD_NUMBER: _ClassVar[int]
    num_deleted: int
    def __init__(self, num_deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierState(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "num_chunks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    num_chunks: int
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "active_leases", "pending_stores", "num_namespaces", "version")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    PENDING_STORES_FIELD_NUMBER: _ClassVar[int]
    NUM_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierState]
    active_leases: int
    pending_stores: int
    num_namespaces: int
    version: str
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierState, _Mapping]]] = ..., active_leases: _Optional[int] = ..., pending_stores: _Optional[int] = ..., num_namespaces: _Optional[int] = ..., version: _Optional[str] = ...) -> None: ...

class MemoryInfo(_message.Message):
    __slots__ = ("memory_id", "size_bytes", "model", "metadata_json")
    MEMORY_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    memory_id: str
    size_bytes: int
    model: str
    metadata_json: str
    def __init__(self, memory_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., model: _Optional[str] = ..., metadata_json: _Optional[str] = ...) -> None: ...

class MemoryHeader(_message.Message):
    __slots__ = ("length", "found")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    length: int
    found: bool
    def __init__(self, length: _Optional[int] = ..., found: _Optional[bool] = ...) -> None: ...

class MemoryPart(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: MemoryHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[MemoryHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutMemoryResponse(_message.Message):
    __slots__ = ("memory", "created")
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    memory: MemoryInfo
    created: bool
    def __init__(self, memory: _Optional[_Union[MemoryInfo, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class GetMemoryRequest(_message.Message):
    __slots__ = ("memory_id",)
    MEMORY_ID_FIELD_NUMBER: _ClassVar[int]
    memory_id: str
    def __init__(self, memory_id: _Optional[str] = ...) -> None: ...

class ListMemoriesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListMemoriesResponse(_message.Message):
    __slots__ = ("memories",)
    MEMORIES_FIELD_NUMBER: _ClassVar[int]
    memories: _containers.RepeatedCompositeFieldContainer[MemoryInfo]
    def __init__(self, memories: _Optional[_Iterable[_Union[MemoryInfo, _Mapping]]] = ...) -> None: ...

class DeleteMemoryRequest(_message.Message):
    __slots__ = ("memory_id",)
    MEMORY_ID_FIELD_NUMBER: _ClassVar[int]
    memory_id: str
    def __init__(self, memory_id: _Optional[str] = ...) -> None: ...

class DeleteMemoryResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

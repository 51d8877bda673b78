"""The server's configuration: one typed object, validated once at start-up.

Sources, later ones winning: embedded defaults < a YAML or TOML file (``--config``) <
``LMCACHE_SVC_*`` environment variables (``__`` separates sections, e.g.
``LMCACHE_SVC_CPU__CAPACITY=4GiB``) < command-line flags. Every field is documented in
``docs/configuration.md``. Errors name the field and what was wrong with it.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from lmcache_svc.client.defaults import default_socket_path
from lmcache_svc.errors import ConfigError
from lmcache_svc.server.events.settings import EventsSettings

ENV_PREFIX = "LMCACHE_SVC_"
OTHER_ENV_PREFIXES = (ENV_PREFIX + "VLLM_", ENV_PREFIX + "TEST_")
"""Variables of the vLLM plugin (``LMCACHE_SVC_VLLM_TRACE``) and of the tests, not server
settings: an environment shared with an engine must not stop the server."""
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader when PyYAML has it (4x faster: a 5,000-entry tokens file reads in
0.7 s instead of 3), else the pure-Python one."""
MAX_YAML_NESTING = 64
"""Deepest nesting of lists and mappings a YAML file may have. Checked on libyaml's event
stream (iterative) before loading: PyYAML up to 6.0.3 bundles libyaml 0.2.5, whose loader
recurses in C once per level and crashes the process (SIGSEGV) on a file nested some
10,000 deep; the check costs about a quarter of a load."""
SLOW_REDIS_CALL_S = 1.0
"""Upper bound of ``RedisConfig.slow_call_s()``."""
MOVED_KEYS = {
    "cache.checksum_quiet_s": "tuning.checksum_quiet_s",
    "cache.checksum_max_delay_s": "tuning.checksum_max_delay_s",
    "cpu.lookup_index_slots": "tuning.lookup_index_slots",
    "cpu.lookup_index_tenants": "tuning.lookup_index_tenants",
}
"""Keys of earlier releases -> where they are now; setting the old one is an error naming
the new one (in every source: file, environment, flags)."""
REMOVED_KEYS = {
    "redis.slow_call_s": "it is now derived from redis.timeout_s (half of it, at most 1 s): "
    "set redis.timeout_s instead",
}
"""Keys of earlier releases that are gone -> what to do instead."""


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )


class CpuConfig(_Section):
    capacity: ByteSize = Field(ByteSize(1 << 30), gt=0)
    """Size of the shared-memory arena (the first tier)."""
    slab: ByteSize | None = Field(None, ge=4096)
    """Slab size of the allocator; chunks larger than a slab take a run of slabs. Default:
    capacity / 16, at most 64 MiB (so a small arena still has slabs for several chunk
    sizes)."""
    shm_name: str | None = None
    """Name under /dev/shm; default: lmcache-svc-<pid>-<random>."""
    shm_mode: int = Field(0o600, ge=0, le=0o777)
    """Permissions of the segment: 0o600 = only the server's user may map it."""
    prefault: Literal["off", "background", "sync"] = "background"
    """Populate the arena's pages at start-up (first touches are slow): in a background
    thread, before serving, or not at all."""
    lookup_index: bool = True
    """Publish, per tenant, a read-only table of the arena's chunks in shared memory, so a
    client on this host answers lookups without a round trip (docs/architecture.md,
    "Lookup index"). Its segments get ``shm_mode``; their sizes are in ``tuning``."""

    @field_validator("shm_mode", mode="before")
    @classmethod
    def _octal(cls, value: Any) -> Any:
        return _parse_octal(value)

    def slab_bytes(self) -> int:
        if self.slab is not None:
            return int(self.slab)
        return min(64 << 20, max(4096, int(self.capacity) // 16 // 4096 * 4096))


class SsdConfig(_Section):
    path: Path | None = None
    """Directory of the SSD tier; no SSD tier when unset."""
    capacity: ByteSize = Field(ByteSize(16 << 30), gt=0)
    """Bytes of chunk files (headers and padding included) the tier may hold."""
    fsync: Literal["never", "always"] = "never"
    """"always": fsync each file before its rename and the directory after. "never": a
    crash may lose recent chunks, never serve torn ones (checksums are verified on read)."""
    o_direct: bool = False
    """Bypass the page cache (O_DIRECT); the filesystem must support it (tmpfs does not)."""
    accept_demotions: bool = True
    """Chunks evicted from the arena move here instead of being dropped."""
    write_through: bool = False
    """Copy every committed chunk here in the background."""


class RedisConfig(_Section):
    url: str | None = None
    """redis://, rediss:// or unix:// URL; no Redis tier when unset."""
    cluster: bool = False
    """The URL names one node of a Redis Cluster."""
    capacity: ByteSize = Field(ByteSize(8 << 30), gt=0)
    """Payload bytes this server may keep in Redis; Redis's own maxmemory is
    the backstop for what several servers share."""
    ttl_s: float | None = Field(None, gt=0)
    """Expire chunks in Redis after this many seconds (none: keep until evicted)."""
    connections: int = Field(4, ge=1, le=64)
    """Parallel connections for batched transfers."""
    key_prefix: str = "lmcache-svc:v1:"
    """Prefix of every Redis key this tier writes."""
    timeout_s: float = Field(2.0, gt=0, le=60)
    """Socket timeout of every Redis call: a dead Redis is a miss, never a hang. A
    lookup-sized call in flight for half of it (at most 1 s, ``slow_call_s()``) marks Redis
    down for every other caller at once."""
    breaker_backoff_s: float = Field(0.5, gt=0, le=3600)
    """After a failed or timed-out call, Redis is skipped (a miss) this long before one probe
    call; each failed probe doubles it."""
    breaker_max_backoff_s: float = Field(30.0, gt=0, le=3600)
    """Cap of the doubled backoff."""
    accept_demotions: bool = True
    """Chunks evicted from the tiers above move here (when not already written through)."""
    write_through: bool = True
    """Copy every committed chunk here in the background, so other servers can find it."""

    def slow_call_s(self) -> float:
        """How long a lookup-sized call (presence, size, delete: well under a millisecond
        on a healthy Redis) may be in flight before Redis counts as hung: half the timeout,
        at most ``SLOW_REDIS_CALL_S``."""
        return min(self.timeout_s / 2, SLOW_REDIS_CALL_S)

    @model_validator(mode="after")
    def _check_url(self) -> RedisConfig:
        if self.breaker_backoff_s > self.breaker_max_backoff_s:
            raise ValueError(
                f"breaker_backoff_s ({self.breaker_backoff_s}) must not exceed "
                f"breaker_max_backoff_s ({self.breaker_max_backoff_s})"
            )
        if self.url is not None and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"url must start with redis://, rediss:// or unix://, got {self.url!r}"
            )
        return self


class HbmConfig(_Section):
    capacity: ByteSize | None = Field(None, gt=0)
    """GPU memory the server holds as the HBM tier (a CUDA IPC pool, docs/gpu.md); no HBM
    tier when unset. Needs a CUDA build of torch and a visible device, else start-up fails."""
    device: int = Field(0, ge=0)
    """CUDA device index of the HBM tier's pool."""
    slab: ByteSize | None = Field(None, ge=4096)
    """Slab size of the pool's allocator. Default: capacity / 16, at most 64 MiB."""
    accept_demotions: bool = True
    """Chunks evicted from the arena move here (before SSD and Redis)."""

    def slab_bytes(self) -> int:
        if self.slab is not None:
            return int(self.slab)
        return min(64 << 20, max(4096, int(self.capacity or 0) // 16 // 4096 * 4096))


class CacheConfig(_Section):
    high_watermark: float = Field(0.95, gt=0, le=1)
    """Background eviction starts when the arena is fuller than this fraction."""
    low_watermark: float = Field(0.85, gt=0, le=1)
    """... and stops when it is back under this fraction."""
    lease_ttl_s: float = Field(30.0, gt=0)
    """Default lifetime of a load lease (pinned chunks) when the client gives none."""
    max_lease_ttl_s: float = Field(600.0, gt=0)
    """Longest lease lifetime a client may ask for."""
    reservation_ttl_s: float = Field(30.0, gt=0)
    """Default lifetime of a store reservation before it expires (an inline upload's is
    extended while its data keeps arriving)."""
    max_reservation_ttl_s: float = Field(120.0, gt=0)
    """Longest store reservation lifetime a client may ask for (or an inline upload may
    last); its slots are unusable meanwhile."""
    max_reserved_fraction: float = Field(0.5, gt=0, le=1)
    """Most of the arena one session (or one inline upload) may hold reserved, expired
    reservations it has not committed or aborted yet included; over it, PrepareStore fails
    with reservation_limit (gRPC RESOURCE_EXHAUSTED). An owner holding nothing may always
    reserve one chunk."""
    max_tenant_reserved_fraction: float = Field(0.75, gt=0, le=1)
    """Most of the arena one tenant may hold reserved, all its sessions and inline uploads
    together (quarantined reservations included until their owner commits, aborts or its
    session ends); over it, reservation_limit (1: no share of its own). A tenant holding
    nothing may always reserve one chunk."""
    max_tenant_leases: int = Field(4096, ge=2)
    """Most load leases one tenant holds at once; its session-less leases (which no session
    end gives back) at most half of them. Over it, PrepareLoad fails with lease_limit
    (RESOURCE_EXHAUSTED)."""
    max_tenant_leased_chunks: int = Field(131072, ge=2)
    """Most chunks one tenant's leases pin at once, a chunk in two leases counted twice
    (about 100 bytes of bookkeeping each: 13 MiB); session-less leases at most half. A load
    counts the chunks it asks for while it runs, then those it pinned."""
    max_chunks_per_request: int = Field(8192, ge=1)
    """Most chunk hashes accepted in one request."""
    max_namespaces: int = Field(4096, ge=1)
    """Most namespaces registered at once; one more is refused (RESOURCE_EXHAUSTED / 507)
    until the server restarts. Registering an existing namespace again always works."""
    checksums: bool = True
    """Keep an xxh3-64 checksum of each arena chunk (taken in the background after commit
    or promotion; 8 bytes per 4 KiB of arena), checked before a chunk is demoted or written
    through and when a load or get asks ``verify``: a chunk that fails is dropped. When
    they are taken: ``tuning.checksum_quiet_s`` and ``tuning.checksum_max_delay_s``."""
    maintenance_interval_s: float = Field(0.05, gt=0, le=60)
    """How often the background maintenance runs: it expires leases and reservations past
    their deadlines, evicts down to low_watermark and probes lower tiers marked down."""

    @model_validator(mode="after")
    def _check_watermarks(self) -> CacheConfig:
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f"low_watermark ({self.low_watermark}) must be below high_watermark "
                f"({self.high_watermark})"
            )
        if self.reservation_ttl_s > self.max_reservation_ttl_s:
            raise ValueError(
                f"reservation_ttl_s ({self.reservation_ttl_s}) must not exceed "
                f"max_reservation_ttl_s ({self.max_reservation_ttl_s})"
            )
        return self


class TuningConfig(_Section):
    """Values the benchmarks chose (docs/benchmarks.md): leave them unless a measurement on
    your hardware says otherwise. Each one says what it trades."""

    checksum_quiet_s: float = Field(0.05, ge=0, le=60)
    """The background checksums (``cache.checksums``) wait until no chunk has been
    committed for this long (stores still arriving: the hashing would slow the client's
    copies) ..."""
    checksum_max_delay_s: float = Field(1.0, ge=0, le=60)
    """... or until the oldest chunk waiting has waited this long (under steady stores)."""
    lookup_index_slots: int = Field(1 << 18, ge=8)
    """Slots of each tenant's lookup-index table (``cpu.lookup_index``), a power of two; 8
    bytes each (default 2 MiB). It indexes up to 3/4 of its slots in chunks; past that,
    clients ask the server for misses. Raise it when the arena holds more chunks than that
    (about ``cpu.capacity`` / chunk bytes)."""
    lookup_index_tenants: int = Field(16, ge=1)
    """Most tenants with a lookup-index table; later tenants' clients use gRPC Lookup (the
    server logs a warning when a tenant finds none free)."""

    @field_validator("lookup_index_slots")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"must be a power of two, got {value}")
        return value


class MemoryConfig(_Section):
    capacity: ByteSize = Field(ByteSize(1 << 30), gt=0)
    """Bytes of named memories (whole blobs, all tenants) the server keeps; a put that does
    not fit is refused (507), memories are never evicted."""
    max_bytes: ByteSize = Field(ByteSize(256 << 20), gt=0)
    """Largest single memory. Over REST a body is also bounded by max_body_bytes."""
    path: Path | None = None
    """Directory where memories persist across restarts. Default: <ssd.path>/memories when
    an SSD tier is configured, else none (memories are kept in RAM and lost on restart)."""
    max_transfers: int = Field(8, ge=1, le=1024)
    """Memory reads and uploads in flight at once (REST and gRPC together); one more is
    refused with too_busy (429 / RESOURCE_EXHAUSTED). A read holds one piece (1-4 MiB) at a
    time, an upload its body (up to max_bytes)."""

    def resolved_path(self, ssd_path: Path | None) -> Path | None:
        if self.path is not None:
            return self.path
        return ssd_path / "memories" if ssd_path is not None else None


class HttpConfig(_Section):
    max_json_bytes: ByteSize = Field(ByteSize(4 << 20), gt=0)
    """Largest JSON request body (/v1/namespaces, /v1/keys, /v1/lookup); larger ones get 413
    before they are parsed. Chunk bodies are bounded by max_body_bytes instead."""
    header_timeout_s: float = Field(10.0, gt=0, le=3600)
    """A connection that has not sent a complete request head this long after it opened
    (or after its previous response) is closed."""
    body_idle_timeout_s: float = Field(30.0, gt=0, le=3600)
    """A request whose body makes no progress for this long is answered 408 and closed."""
    keep_alive_s: float = Field(5.0, gt=0, le=3600)
    """An idle keep-alive connection is closed after this long."""
    max_connections: int = Field(256, ge=1, le=65536)
    """Most HTTP connections served at once (requests in flight count too); requests on
    connections beyond it get 503."""


class Config(_Section):
    host: str = "127.0.0.1"
    """Address of the TCP listeners (gRPC and HTTP). Not loopback requires auth_token or
    tokens_file."""
    http_port: int | None = Field(8080, ge=0, le=65535)
    """REST port; 0 = any free port; null = no REST listener."""
    grpc_port: int | None = Field(50051, ge=0, le=65535)
    """gRPC TCP port; 0 = any free port; null = Unix socket only."""
    socket: Path | None = Field(default_factory=default_socket_path)
    """gRPC Unix socket path; null = TCP only."""
    socket_mode: int = Field(0o600, ge=0, le=0o777)
    """Permissions of the Unix socket: 0o600 = only the server's user may connect; 0o660 lets
    the engine's group in (its directory is made 0o711 then)."""
    auth_token: str | None = None
    """Admin bearer token (every tenant, stats, metrics); authentication is on when this or
    tokens_file is set (health checks stay open)."""
    tokens_file: Path | None = None
    """YAML/TOML file of per-tenant tokens (docs/security.md); re-read when it changes and on
    SIGHUP."""
    allow_unauthenticated: bool = False
    """Allow a non-loopback host without auth_token (not recommended)."""
    max_body_bytes: ByteSize = Field(ByteSize(256 << 20), gt=0)
    """Largest inline chunk body accepted over REST or gRPC."""
    grpc_workers: int = Field(16, ge=1, le=256)
    """Threads that run cache calls which may block (lower tiers, bulk copies)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Server log level."""
    ready_file: Path | None = None
    """Where to write a JSON line with the bound addresses once serving (for supervisors)."""
    http: HttpConfig = Field(default_factory=HttpConfig)
    cpu: CpuConfig = Field(default_factory=CpuConfig)
    hbm: HbmConfig = Field(default_factory=HbmConfig)
    ssd: SsdConfig = Field(default_factory=SsdConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    events: EventsSettings = Field(default_factory=EventsSettings)
    tuning: TuningConfig = Field(default_factory=TuningConfig)

    @field_validator("socket_mode", mode="before")
    @classmethod
    def _octal(cls, value: Any) -> Any:
        return _parse_octal(value)

    @model_validator(mode="after")
    def _check_exposure(self) -> Config:
        if self.http_port is None and self.grpc_port is None and self.socket is None:
            raise ValueError("no listener: set http_port, grpc_port or socket")
        if self.auth_token is not None and len(self.auth_token) < 16:
            raise ValueError("auth_token must be at least 16 characters")
        if (
            not _is_loopback(self.host)
            and self.auth_token is None
            and self.tokens_file is None
            and not self.allow_unauthenticated
        ):
            raise ValueError(
                f"host {self.host!r} is reachable from other machines: set auth_token or "
                "tokens_file (or allow_unauthenticated: true if a network policy protects "
                "the port)"
            )
        exposed = self.events.exposed() if self.events.enabled else []
        if exposed and not self.events.allow_remote:
            raise ValueError(
                f"events endpoint {exposed[0]} is reachable from other machines and the events "
                "carry every prompt's token ids: bind loopback, or set events.allow_remote"
            )
        return self


def _parse_octal(value: Any) -> Any:
    """Accept "0o660" / "660" strings as octal (YAML reads 0o660 as a string)."""
    if isinstance(value, str):
        try:
            return int(value.removeprefix("0o"), 8)
        except ValueError:
            raise ValueError(f"must be octal like 0o600, got {value!r}") from None
    return value


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Merge file, environment and flag overrides (dotted keys) over the defaults."""
    data: dict[str, Any] = read_config_file(path) if path is not None else {}
    for dotted, value in _env_overrides(os.environ if env is None else env).items():
        _set_dotted(data, dotted, value)
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    _check_old_keys(data)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


def _check_old_keys(data: Mapping[str, Any]) -> None:
    """A key of an earlier release is an error that says where it went."""
    for old, new in MOVED_KEYS.items():
        if _has_dotted(data, old):
            raise ConfigError(
                f"{old} ({_env_name(old)}) has moved to {new} ({_env_name(new)}): set it there"
            )
    for old, instead in REMOVED_KEYS.items():
        if _has_dotted(data, old):
            raise ConfigError(f"{old} ({_env_name(old)}) was removed: {instead}")


def _has_dotted(data: Mapping[str, Any], dotted: str) -> bool:
    *parents, leaf = dotted.split(".")
    node: Any = data
    for part in parents:
        node = node.get(part) if isinstance(node, Mapping) else None
    return isinstance(node, Mapping) and leaf in node


def _env_name(dotted: str) -> str:
    return ENV_PREFIX + dotted.upper().replace(".", "__")


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {p} is not UTF-8 text ({e})") from None
    kind = p.suffix.lstrip(".") or "YAML"
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            _check_yaml_nesting(p, text)
            data = yaml.load(text, Loader=_YAML_LOADER)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"config file {p} is not valid {kind}: {e}") from None
    except RecursionError:
        raise ConfigError(f"config file {p} is nested too deeply to be read") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at the top level")
    return data


def _check_yaml_nesting(p: Path, text: str) -> None:
    depth = 0
    for event in yaml.parse(text, Loader=_YAML_LOADER):
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_YAML_NESTING:
                raise ConfigError(
                    f"config file {p} is nested too deeply to be read (more than "
                    f"{MAX_YAML_NESTING} levels of lists and mappings)"
                )
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in env.items():
        if name.startswith(ENV_PREFIX) and name != ENV_PREFIX + "CONFIG":
            if name.startswith(OTHER_ENV_PREFIXES):
                continue
            dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
            out[dotted] = None if value.lower() in ("null", "none") else value
    return out


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {dotted}: {part} is not a section")
        node = child
    node[leaf] = value


def format_validation_error(error: ValidationError) -> str:
    lines = ["invalid configuration:"]
    for item in error.errors():
        where = ".".join(str(x) for x in item["loc"]) or "(top level)"
        got = (
            f" (got {item['input']!r})"
            if "input" in item and not isinstance(item["input"], dict)
            else ""
        )
        lines.append(f"  {where}: {item['msg']}{got}")
    return "\n".join(lines)

"""The plugin's settings: ``kv_connector_extra_config`` parsed and validated once.

Every key is documented in ``docs/vllm.md``; an unknown key or a value of the wrong type
is a start-up error that names the key, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, get_args

from lmcache_svc.errors import ConfigError

LoadMode = Literal["auto", "sync", "async"]
AUTH_TOKEN_ENV = "LMCACHE_SVC_AUTH_TOKEN"
MIN_DEFAULT_CHUNK_TOKENS = 128
"""The default chunk is the smallest multiple of vLLM's block size with at least this many
tokens: vLLM's block itself on the CPU backend (128), 8 blocks under CUDA's 16."""


MOVED_TO_TUNING = frozenset({"lookup_wait_ms", "store_pool_chunks"})
"""Top-level keys of earlier releases that now go in the ``tuning`` mapping."""


def default_chunk_size(block_size: int) -> int:
    """The chunk size used when ``chunk_size`` is not configured, for a given block size."""
    if block_size < 1:
        raise ConfigError(f"vLLM's block size must be >= 1, got {block_size!r}")
    return -(-MIN_DEFAULT_CHUNK_TOKENS // block_size) * block_size


@dataclass(frozen=True, slots=True)
class Tuning:
    """``kv_connector_extra_config["tuning"]``: values the benchmarks chose
    (docs/benchmarks.md); leave them unless a measurement on your hardware says otherwise."""

    lookup_wait_ms: float = 5.0
    """How long the scheduler waits inline for a lookup's answer; past it, vLLM is told
    "not decided yet", runs its other requests, and asks again next step (0: never wait)."""
    overlap_load_min_bytes: int = 4 << 20
    """With ``overlap_loads``: a load of at least this many bytes copies beside the forward
    pass; a smaller one copies before it. The copy thread shares the GIL and a core with
    the engine: a 1 MiB load took 0.60-0.80 ms there against 0.29 ms in the caller, and
    the first token's output phase 0.8-1.0 ms more (docs/benchmarks.md, 2026-11-28)."""
    store_pool_chunks: int = 0
    """Most shared-memory slots the worker keeps reserved ahead of its stores (it keeps
    twice as many as its largest store so far needed), so a store copies without waiting for a
    reservation; they count against the session's reservation limit. 0: no pool."""

    def __post_init__(self) -> None:
        for name in ("lookup_wait_ms", "overlap_load_min_bytes", "store_pool_chunks"):
            if getattr(self, name) < 0:
                raise ConfigError(f"tuning.{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Validated ``kv_connector_extra_config``; field docs are the user-facing reference."""

    url: str | None = None
    """Server address: a Unix socket path (``/run/x.sock``, ``unix:/run/x.sock``) or
    ``host:port``. Default: the server's default socket path."""
    tenant: str = "default"
    """Isolation label hashed into every key; engines of different tenants never share."""
    model_id: str | None = None
    """Name of the model in the key namespace. Default: vLLM's ``--model`` value."""
    chunk_size: int | None = None
    """Tokens per stored chunk; a multiple of vLLM's block size. Default (``None``): the
    smallest multiple of the block size of at least 128 tokens (``default_chunk_size``),
    resolved by ``for_block_size`` once the engine's block size is known."""
    lookup_timeout_ms: float = 100.0
    """Deadline of the scheduler's lookup; a slower answer counts as a miss."""
    rpc_timeout_ms: float = 2000.0
    """Deadline of the worker's store/load calls (prepare, commit, release)."""
    retry_interval_s: float = 1.0
    """After a failed call, skip the server this long (all misses), then try again."""
    load_mode: LoadMode = "auto"
    """``sync``: load inside the step that needs the KV. ``async``: load in the background
    while other requests run (the request waits a step or two). ``auto``: async only for
    loads of at least ``async_load_min_tokens`` while other requests are running."""
    async_load_min_tokens: int = 4096
    """``auto`` mode's threshold for the async path."""
    use_shm: bool = True
    """Move bytes through the server's shared segment when it is mapped here; ``false``
    (or another host) streams them inline over gRPC instead."""
    local_lookup: bool = True
    """Answer the scheduler's lookups from the server's shared-memory index when it is
    mapped here (same host, ``use_shm``), without a round trip; otherwise, or when the
    index cannot tell (a lower tier, an overflowed table), ask the server."""
    read_in_place: bool = True
    """Load chunks the server's shared-memory index locates in the mapped segment without
    the lease round trip, checking afterwards that none changed during the copy (one that
    did is loaded again under a lease). CPU copies only; ``false``: every load leases."""
    pretouch_loads: bool = False
    """Read one byte of every memory page of a hit's chunks in the shared segment on the
    scheduler's lookup thread as soon as vLLM gives the request its blocks, before the
    worker copies them (``pretouch.py``): memory idle a while can be slow to read again."""
    overlap_loads: bool = True
    """CPU: a step's load copies on a thread of its own beside the forward pass, each layer
    in place before its attention runs (``copy_thread.py``); a chunk read in place that
    changed during the copy is then recomputed rather than loaded again. ``false``: every
    layer is copied before the forward pass."""
    auth_token: str | None = None
    """Bearer token for a server started with auth; default: $LMCACHE_SVC_AUTH_TOKEN."""
    keep_load_failure_policy: bool = False
    """By default the plugin sets vLLM's ``kv_load_failure_policy`` to ``recompute`` (a
    cache that is down must not fail requests); ``true`` keeps the value you configured."""
    tuning: Tuning = field(default_factory=Tuning)
    """Values the benchmarks chose (the ``tuning`` mapping of the extra config)."""

    def __post_init__(self) -> None:
        if self.chunk_size is not None:
            _check_positive("chunk_size", self.chunk_size)
        _check_positive("async_load_min_tokens", self.async_load_min_tokens)
        for name in ("lookup_timeout_ms", "rpc_timeout_ms"):
            _check_positive(name, getattr(self, name))
        if self.retry_interval_s < 0:
            raise ConfigError(f"retry_interval_s must be >= 0, got {self.retry_interval_s!r}")
        if self.load_mode not in get_args(LoadMode):
            raise ConfigError(
                f"load_mode must be one of {list(get_args(LoadMode))}, got {self.load_mode!r}"
            )
        for name in ("tenant", "model_id", "url"):
            value = getattr(self, name)
            if value is not None and not value:
                raise ConfigError(f"{name} must not be empty")

    def check_block_size(self, block_size: int) -> None:
        """A configured ``chunk_size`` must be a whole number of vLLM's blocks."""
        if self.chunk_size is not None and self.chunk_size % block_size:
            raise ConfigError(
                f"chunk_size {self.chunk_size} must be a multiple of vLLM's block size "
                f"{block_size} (set kv_connector_extra_config.chunk_size to one, e.g. "
                f"{default_chunk_size(block_size)}, leave it unset, or change --block-size)"
            )

    def for_block_size(self, block_size: int) -> ConnectorConfig:
        """This config with ``chunk_size`` resolved for the engine's block size: checked if
        configured, else ``default_chunk_size(block_size)``."""
        self.check_block_size(block_size)
        if self.chunk_size is not None:
            return self
        return replace(self, chunk_size=default_chunk_size(block_size))

    def resolved_chunk_size(self) -> int:
        """The chunk size of a config returned by ``for_block_size``."""
        if self.chunk_size is None:
            raise ConfigError("chunk_size is not resolved: call for_block_size first")
        return self.chunk_size

    def resolved_auth_token(self) -> str | None:
        return self.auth_token or os.environ.get(AUTH_TOKEN_ENV) or None


# Types of ConnectorConfig's and Tuning's keys together (no name is in both).
_FLOAT_FIELDS = {"lookup_timeout_ms", "lookup_wait_ms", "rpc_timeout_ms", "retry_interval_s"}
_INT_FIELDS = {
    "chunk_size",
    "async_load_min_tokens",
    "overlap_load_min_bytes",
    "store_pool_chunks",
}
_BOOL_FIELDS = {
    "use_shm",
    "local_lookup",
    "read_in_place",
    "pretouch_loads",
    "overlap_loads",
    "keep_load_failure_policy",
}
_OPTIONAL_FIELDS = {"chunk_size"}  # null: the default


def parse_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """``kv_connector_extra_config`` -> ``ConnectorConfig``, naming any bad key."""
    extra = dict(extra or {})
    moved = sorted(set(extra) & MOVED_TO_TUNING)
    if moved:
        raise ConfigError(
            f"kv_connector_extra_config key(s) {moved} have moved into its tuning mapping: "
            f'write {{"tuning": {{"{moved[0]}": ...}}}} instead'
        )
    tuning = _parse_tuning(extra.pop("tuning", None))
    values = _parse_keys(extra, [f.name for f in fields(ConnectorConfig)])
    return ConnectorConfig(**values, tuning=tuning)


def _parse_tuning(value: Any) -> Tuning:
    if value is None:
        return Tuning()
    if not isinstance(value, Mapping):
        raise ConfigError(f"tuning must be a mapping of key to value, got {value!r}")
    return Tuning(**_parse_keys(value, [f.name for f in fields(Tuning)], where="tuning"))


def _parse_keys(values: Mapping[str, Any], known: list[str], where: str = "") -> dict[str, Any]:
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {unknown} in kv_connector_extra_config"
            f"{'.' + where if where else ''} for LMCacheSvcConnector; known keys: {known}"
        )
    return {name: _coerce(name, value) for name, value in values.items()}


def _coerce(name: str, value: Any) -> Any:
    if name in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return value
    if name in _INT_FIELDS:
        if name in _OPTIONAL_FIELDS and value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        return value
    if name in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        return float(value)
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {value!r}")
    return value


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")

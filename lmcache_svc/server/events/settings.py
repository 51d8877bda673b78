"""The ``events`` section of the server's configuration (``docs/events.md``)."""

from __future__ import annotations

import socket
import string

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lmcache_svc.keys import Namespace

TOPIC_FIELDS = frozenset({"node", "model", "tenant", "namespace"})


class EventsSettings(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )

    enabled: bool = False
    """Publish what the tiers hold as KV events in vLLM's format (a ZMQ PUB socket), and
    keep each stored chunk's token ids for them."""
    endpoint: str = "tcp://127.0.0.1:5570"
    """ZMQ PUB endpoint the server binds (tcp://host:port, port 0 = any free one, or
    ipc://path). The events carry token ids: a host that is not loopback needs
    allow_remote."""
    replay_endpoint: str | None = "tcp://127.0.0.1:5571"
    """ZMQ ROUTER endpoint for replays and snapshots; null = none."""
    allow_remote: bool = False
    """Allow non-loopback endpoints (subscribers there read every published prompt's token
    ids)."""
    node: str = Field(default_factory=socket.gethostname, min_length=1)
    """This node's name in topics (default: the host name)."""
    topic: str = "kv@node:{node}@{model}"
    """Topic of each namespace's batches; {node}, {model}, {tenant} and {namespace} (the
    namespace id in hex) are filled in. Two published namespaces must not share a topic."""
    tenants: list[str] | None = None
    """Publish only these tenants' namespaces (default: every tenant's)."""
    buffer_steps: int = Field(10_000, ge=1)
    """Batches kept for the replay socket."""
    max_pending: int = Field(100_000, ge=1)
    """Events queued for the publisher thread at most; past it they are dropped (counted)
    and every topic is cleared and announced again. Also bounds the tier changes recorded
    for the publisher thread and not yet applied: past it each store applies two."""
    max_chunks: int = Field(262_144, ge=1)
    """Chunks whose token ids are kept (about 4 bytes per token plus ~150 bytes each);
    the least recently stored are forgotten first. Also the most descriptions read back
    per SSD or Redis tier from the stored values at start-up and per resync."""
    hwm: int = Field(100_000, ge=1)
    """ZMQ high-water mark of the PUB socket (messages queued per subscriber)."""
    redis_channel: bool = True
    """With a Redis tier: announce this server's Redis writes and deletes on a Redis
    pub/sub channel (<key_prefix>events) and announce what other servers announce there."""

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.startswith(("tcp://", "ipc://")):
            raise ValueError(f"must be tcp://host:port or ipc://path, got {value!r}")
        if value.startswith("tcp://") and value.rpartition(":")[0] == "tcp:/":
            raise ValueError(f"must name a host and a port, got {value!r}")
        return value

    @field_validator("topic")
    @classmethod
    def _check_topic(cls, value: str) -> str:
        names = {f for _, f, _, _ in string.Formatter().parse(value) if f is not None}
        unknown = names - TOPIC_FIELDS
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)}; use {sorted(TOPIC_FIELDS)}")
        return value

    def exposed(self) -> list[str]:
        """Endpoints reachable from other machines."""
        return [e for e in (self.endpoint, self.replay_endpoint) if e and not _loopback(e)]

    def topic_for(self, namespace: Namespace) -> str:
        return self.topic.format(
            node=self.node,
            model=namespace.model,
            tenant=namespace.tenant,
            namespace=namespace.namespace_id.hex(),
        )


def _loopback(endpoint: str) -> bool:
    if endpoint.startswith("ipc://"):
        return True
    from lmcache_svc.config import _is_loopback  # config imports this module

    return _is_loopback(endpoint[len("tcp://") :].rpartition(":")[0].strip("[]"))

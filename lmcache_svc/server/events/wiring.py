"""Building the event stream from the configuration, and the server's view of it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lmcache_svc.server.events.metrics import EventMetrics
from lmcache_svc.server.events.node_stream import NodeEvents

if TYPE_CHECKING:
    from lmcache_svc.cache import TieredCache
    from lmcache_svc.config import Config
    from lmcache_svc.metrics import Metrics
    from lmcache_svc.tiers.base import Tier


def node_events(config: Config, metrics: Metrics, lower: Sequence[Tier]) -> NodeEvents | None:
    """The node-level stream when ``events.enabled`` (binds its sockets now), with the Redis
    announce channel when a Redis tier is configured and ``events.redis_channel`` is on."""
    if not config.events.enabled:
        return None
    events = NodeEvents(config.events, EventMetrics(metrics.registry))
    if config.events.redis_channel and config.redis.url is not None:
        from lmcache_svc.server.events.redis_channel import RedisChannel

        shared = [t for t in lower if t.shared]
        if shared:
            events.attach_channel(RedisChannel.for_config(config, shared[0], events))
    return events


def events_of(cache: TieredCache) -> NodeEvents | None:
    listener = cache.listener
    return listener if isinstance(listener, NodeEvents) else None


def events_addresses(cache: TieredCache) -> dict[str, Any]:
    """What the ready line says about the stream."""
    events = events_of(cache)
    if events is None:
        return {}
    p = events.publisher
    return {"events": p.endpoint, "events_replay": p.replay_endpoint}


def close_events(cache: TieredCache) -> None:
    events = events_of(cache)
    if events is not None:
        events.close()

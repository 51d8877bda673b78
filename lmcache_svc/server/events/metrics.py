"""The event stream's Prometheus metrics, registered in the server's registry
(``docs/metrics.md``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class EventMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches = Counter(
            "lmcache_svc_events_batches",
            "Event batches sent on the node-level stream (ZMQ PUB)",
            registry=registry,
        )
        self.dropped_events = Counter(
            "lmcache_svc_events_dropped",
            "Events dropped because the queue to the publisher was full (events.max_pending),"
            " or queued while a resync was due; replaced by AllBlocksCleared and a full"
            " re-announcement",
            registry=registry,
        )
        self.dropped_batches = Counter(
            "lmcache_svc_events_lost_batches",
            "Numbered batches that left the replay buffer before the publisher sent them",
            registry=registry,
        )
        self.resyncs = Counter(
            "lmcache_svc_events_resyncs",
            "Overflows of the queue to the publisher, each answered by one full"
            " re-announcement per topic",
            registry=registry,
        )
        self.unannounced = Counter(
            "lmcache_svc_events_unannounced",
            "Chunks that became loadable in a tier but were not announced: no_tokens (stored "
            "without token ids, or their description was dropped), no_parent (their parent "
            "chunk is in no tier), bad_description (a description stored with an SSD or Redis "
            "value that is not the chunk's)",
            ["reason"],
            registry=registry,
        )
        self.remote_messages = Counter(
            "lmcache_svc_events_redis_messages",
            "Messages on the Redis announce channel: sent, received (from other servers), bad",
            ["kind"],
            registry=registry,
        )

"""The ``events`` section: bad values are refused with a message naming the field."""

from __future__ import annotations

import pytest

from lmcache_svc.config import load_config
from lmcache_svc.errors import ConfigError
from lmcache_svc.metrics import Metrics
from lmcache_svc.server.events.metrics import EventMetrics
from lmcache_svc.server.events.node_stream import NodeEvents
from lmcache_svc.server.events.settings import EventsSettings
from tests.helpers import make_namespace


def load(**overrides: object):
    return load_config(env={}, overrides={"events.enabled": True, **overrides})


def test_an_endpoint_reachable_from_other_machines_needs_allow_remote() -> None:
    with pytest.raises(ConfigError, match="events endpoint tcp://0.0.0.0:5570 is reachable"):
        load(**{"events.endpoint": "tcp://0.0.0.0:5570"})
    assert load(**{"events.endpoint": "tcp://0.0.0.0:5570", "events.allow_remote": True})
    assert load(**{"events.endpoint": "tcp://[::1]:5570"}).events.enabled


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("events.endpoint", "udp://x:1", "events.endpoint: .*tcp://host:port or ipc://path"),
        ("events.topic", "kv@{node}@{gpu}", r"events.topic: .*unknown field\(s\) \['gpu'\]"),
        ("events.max_chunks", 0, "events.max_chunks"),
        ("events.buffer_steps", -1, "events.buffer_steps"),
    ],
)
def test_bad_values_name_the_field(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(**{key: value})


def test_a_second_namespace_on_the_same_topic_is_not_published(tmp_path) -> None:
    settings = EventsSettings(enabled=True, endpoint=f"ipc://{tmp_path}/p", replay_endpoint=None)
    events = NodeEvents(settings, EventMetrics(Metrics().registry))
    try:
        first, second = make_namespace(), make_namespace(chunk_size=32)  # same model
        events.namespace_registered(first)
        events.namespace_registered(second)
        events.namespace_registered(make_namespace(model="other", tp_rank=1, tp_size=2))
        assert events.topic_of(first.namespace_id) == f"kv@node:{settings.node}@m"
        assert events.topic_of(second.namespace_id) is None
        assert (
            events.topic_of(make_namespace(model="other", tp_rank=1, tp_size=2).namespace_id)
            is None
        )
    finally:
        events.close()

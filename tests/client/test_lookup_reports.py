"""The client's tally of index-answered lookups: summed per namespace, sent once, kept when
the server is unreachable, dropped (not retried forever) when the server refuses it."""

from __future__ import annotations

import logging

import pytest

from lmcache_svc import errors
from lmcache_svc.client.lookup_reports import LookupCounts, LookupReporter

NS_A, NS_B = b"a" * 16, b"b" * 16


class Server:
    """What a server does with reports: takes them, or fails with ``failure``."""

    def __init__(self) -> None:
        self.taken: list[tuple[bytes, LookupCounts]] = []
        self.failure: errors.LMCacheSvcError | None = None

    def send(self, namespace_id: bytes, counts: LookupCounts) -> None:
        if self.failure is not None:
            raise self.failure
        self.taken.append((namespace_id, counts))


def test_counts_are_summed_per_namespace_and_sent_once() -> None:
    server = Server()
    reporter = LookupReporter(server.send, interval_s=3600)
    reporter.count(NS_A, 5, 3)
    reporter.count(NS_A, 1, 0)
    reporter.count(NS_B, 2, 2)
    assert reporter.flush() == 3
    assert sorted(server.taken) == [(NS_A, LookupCounts(2, 6, 3)), (NS_B, LookupCounts(1, 2, 2))]
    assert reporter.flush() == 0 and len(server.taken) == 2
    reporter.count(NS_A, 4, 4)
    assert reporter.close() == 1  # close sends the rest
    assert server.taken[-1] == (NS_A, LookupCounts(1, 4, 4))


def test_an_unreachable_server_gets_the_counts_later() -> None:
    server = Server()
    reporter = LookupReporter(server.send, interval_s=3600)
    reporter.count(NS_A, 5, 3)
    server.failure = errors.ServerUnavailable("down")
    assert reporter.flush() == 0
    reporter.count(NS_A, 1, 1)
    server.failure = None
    assert reporter.flush() == 2
    assert server.taken == [(NS_A, LookupCounts(2, 6, 4))]


def test_a_refused_report_is_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    server = Server()
    reporter = LookupReporter(server.send, interval_s=3600)
    reporter.count(NS_A, 5, 3)
    server.failure = errors.InvalidArgument("no lookup index here")
    with caplog.at_level(logging.WARNING):
        assert reporter.flush() == 0
    assert "no lookup index here" in caplog.text
    reporter.count(NS_A, 1, 1)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert reporter.flush() == 0
    assert caplog.text == ""  # warned once, not every interval
    server.failure = None
    assert reporter.close() == 0 and server.taken == []


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(errors.InvalidArgument):
        LookupReporter(Server().send, interval_s=0)

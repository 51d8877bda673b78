"""The circuit breaker's states, backoff and slow-call trip, on a clock the test drives."""

from __future__ import annotations

import pytest

from lmcache_svc.cache.breaker import CircuitBreaker
from tests.helpers import ManualClock


def make() -> tuple[CircuitBreaker, ManualClock]:
    clock = ManualClock()
    return CircuitBreaker(base_backoff_s=1, max_backoff_s=4, slow_call_s=0.5, clock=clock), clock


def test_a_failure_opens_it_until_a_probe_after_the_backoff_succeeds() -> None:
    breaker, clock = make()
    assert breaker.allow() and breaker.state == "closed"
    breaker.failure()
    assert breaker.state == "open" and breaker.trips == 1
    assert not breaker.allow() and not breaker.may_allow() and not breaker.probe_due()
    assert not breaker.allow_probe()  # not before the backoff
    clock.now += 1.01
    assert breaker.probe_due() and breaker.state == "open"
    assert not breaker.allow() and not breaker.may_allow()  # a caller never probes
    assert breaker.allow_probe()  # the probe (made in the background)
    assert breaker.state == "half_open" and not breaker.allow_probe()  # one at a time
    assert not breaker.allow() and not breaker.probe_due()
    assert breaker.success() is True  # recovered from an outage
    assert breaker.state == "closed" and breaker.allow()


def test_failed_probes_double_the_backoff_up_to_the_cap() -> None:
    breaker, clock = make()
    breaker.failure()
    waits = []
    for _ in range(4):
        start = clock.now
        while not breaker.allow_probe():
            clock.now += 0.25
        waits.append(clock.now - start)
        breaker.failure()
    assert waits == [1.0, 2.0, 4.0, 4.0]
    assert breaker.trips == 1  # failed probes are one outage
    clock.now += 4
    assert breaker.allow_probe()
    breaker.success()
    breaker.failure()
    clock.now += 1.01
    assert breaker.allow_probe()  # the backoff was reset by the success


def test_a_call_hung_past_slow_call_s_trips_it_for_the_others() -> None:
    breaker, clock = make()
    with breaker.track():
        clock.now += 0.4
        assert breaker.allow()
        clock.now += 0.2
        assert not breaker.allow()
        assert breaker.state == "open" and breaker.trips == 1
    assert breaker.success() is False  # the slow call answered: no failure was seen


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="backoff"):
        CircuitBreaker(base_backoff_s=5, max_backoff_s=1)
    with pytest.raises(ValueError, match="slow_call_s"):
        CircuitBreaker(slow_call_s=0)

"""The shared doubling backoff (``lmcache_svc.backoff``), on a clock the test drives."""

from __future__ import annotations

import pytest

from lmcache_svc.backoff import Backoff
from tests.helpers import ManualClock


def make(base_s: float = 1.0, max_s: float = 4.0) -> tuple[Backoff, ManualClock]:
    clock = ManualClock()
    return Backoff(base_s, max_s, clock=clock), clock


def test_failures_wait_base_then_double_up_to_max() -> None:
    backoff, clock = make()
    assert not backoff.waiting() and backoff.delay_s == 1.0
    assert [backoff.failed() for _ in range(5)] == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff.retry_at == 104.0


def test_the_wait_ends_at_retry_at() -> None:
    backoff, clock = make()
    backoff.failed()
    assert backoff.waiting()
    clock.now = 100.999
    assert backoff.waiting()
    clock.now = 101.0
    assert not backoff.waiting()
    assert backoff.failed() == 2.0 and backoff.retry_at == 103.0


def test_a_success_starts_over_from_base_but_keeps_a_wait_in_progress() -> None:
    backoff, clock = make()
    backoff.failed()
    backoff.failed()
    backoff.succeeded()
    assert backoff.delay_s == 1.0 and backoff.waiting()  # a racing success ends no wait
    clock.now += 2
    assert backoff.failed() == 1.0 and backoff.retry_at == clock.now + 1.0


def test_postpone_restarts_the_wait_without_doubling() -> None:
    backoff, clock = make()
    backoff.failed()
    clock.now += 0.5
    backoff.postpone()
    assert backoff.delay_s == 1.0 and backoff.retry_at == 101.5
    clock.now = 90.0  # never earlier than a wait already set
    backoff.postpone()
    assert backoff.retry_at == 101.5
    assert backoff.failed() == 2.0  # still the same outage: the next failure doubles


def test_a_zero_base_never_waits() -> None:
    backoff, _ = make(base_s=0.0, max_s=30.0)
    assert [backoff.failed() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert not backoff.waiting()


@pytest.mark.parametrize(("base_s", "max_s"), [(-1.0, 1.0), (5.0, 1.0)])
def test_bad_bounds_are_refused(base_s: float, max_s: float) -> None:
    with pytest.raises(ValueError, match=r"0 <= base .* <= max"):
        Backoff(base_s, max_s)


def test_end_wait_lets_the_owner_try_now_and_keeps_the_delay() -> None:
    backoff, clock = make()
    backoff.failed()
    assert backoff.failed() == 2.0
    clock.now += 0.5
    backoff.end_wait()
    assert not backoff.waiting() and backoff.retry_at == 100.5 and backoff.delay_s == 2.0
    assert backoff.failed() == 4.0  # still the same outage: the next failure doubles
    clock.now += 10
    backoff.end_wait()  # no wait in progress: nothing moves
    assert backoff.retry_at == 104.5

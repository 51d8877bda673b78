"""The background queues' mechanics: everything submitted is worked through; a paced queue
(the checksums') starts a batch only after ``quiet_s`` without a submission or once its
oldest key has waited ``max_delay_s``, and not at all before that unless flushed or
stopped."""

from __future__ import annotations

import threading
import time

from lmcache_svc.cache.background_queue import BackgroundQueue, Pace
from lmcache_svc.keys import ChunkKey
from tests.helpers import wait_until


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(64, "big"))


class Recorder:
    """The queue's callback: which keys each batch had, and when it started."""

    def __init__(self) -> None:
        self.batches: list[tuple[float, list[ChunkKey]]] = []
        self.lock = threading.Lock()

    def __call__(self, keys: list[ChunkKey]) -> None:
        with self.lock:
            self.batches.append((time.monotonic(), list(keys)))

    @property
    def done(self) -> list[ChunkKey]:
        with self.lock:
            return [k for _, keys in self.batches for k in keys]


def submit_stream(q: BackgroundQueue, num: int, every_s: float) -> list[float]:
    """Submit keys 0..num-1 one at a time; the submission times."""
    times = []
    for i in range(num):
        times.append(time.monotonic())
        q.submit([key(i)])
        time.sleep(every_s)  # the behaviour under test: a stream of submissions
    return times


def test_unpaced_queue_works_through_everything() -> None:
    rec = Recorder()
    q = BackgroundQueue(rec, enabled=True, max_batch=4)
    q.start()
    q.submit([key(i) for i in range(10)])
    assert q.flush(10)
    assert rec.done == [key(i) for i in range(10)]
    assert all(len(keys) <= 4 for _, keys in rec.batches)
    q.stop()


def test_paced_queue_waits_for_a_quiet_moment() -> None:
    rec = Recorder()
    q = BackgroundQueue(rec, enabled=True, pace=Pace(quiet_s=0.3, max_delay_s=60))
    q.start()
    times = submit_stream(q, 10, every_s=0.02)
    wait_until(lambda: len(rec.done) == 10, 10, "every key done")  # without a flush
    assert rec.done == [key(i) for i in range(10)]
    for started, _ in rec.batches:  # never while submissions were coming
        last_before = max(t for t in times if t <= started)
        assert started - last_before >= 0.3
    q.stop()


def test_paced_queue_runs_overdue_keys_under_steady_submissions() -> None:
    rec = Recorder()
    q = BackgroundQueue(rec, enabled=True, pace=Pace(quiet_s=60, max_delay_s=0.2))
    q.start()
    times = submit_stream(q, 40, every_s=0.025)  # never quiet for 60 s
    assert rec.batches, "nothing done in a second of steady submissions"
    for started, keys in rec.batches:  # each batch started once its oldest key was due
        oldest = int.from_bytes(keys[0], "big")
        assert started - times[oldest] >= 0.2
    assert q.flush(10) and rec.done == [key(i) for i in range(40)]
    q.stop()


def test_flush_and_stop_do_not_wait_for_the_pace() -> None:
    rec = Recorder()
    # a pace of an hour: a flush or stop that waited for it would outlast its bound
    q = BackgroundQueue(rec, enabled=True, pace=Pace(quiet_s=3600, max_delay_s=3600))
    q.start()
    q.submit([key(1), key(2)])
    time.sleep(0.1)  # the behaviour under test: a while passes, nothing runs
    assert rec.done == []  # held back by the pace
    assert q.flush(10) and rec.done == [key(1), key(2)]
    q.submit([key(3)])
    stopper = threading.Thread(target=q.stop, daemon=True)
    stopper.start()
    wait_until(lambda: not stopper.is_alive(), 30, "stop returned")
    assert rec.done == [key(1), key(2), key(3)]  # stop finishes what is queued


def test_a_flush_that_times_out_says_so() -> None:
    release = threading.Event()
    q = BackgroundQueue(lambda keys: release.wait(10), enabled=True)
    q.start()
    q.submit([key(1)])
    assert not q.flush(0.1)
    release.set()
    assert q.flush(10)
    q.stop()

"""``python -m lmcache_svc_bench.stats_cost``: what handing the plugin's stats to vLLM costs
the step that carries them, warm and after the engine's idle time.

On a hit's first step the plugin has stats from both halves (the lookup, the load): vLLM
pickles the worker's to the engine core, merges the halves, encodes them with msgpack to
the front end and records them (the log line's accumulator, Prometheus counters and
histograms) before the step's outputs reach the caller. This replays that work with the
plugin's own ``StatsRecorder`` and ``merge``, pickle, msgspec and prometheus_client
(vLLM's own classes around it are not included, so this is a lower bound), ``--repeats``
times warm and ``--repeats`` times each after ``--idle`` seconds asleep, as a query after a
quiet spell finds it. Used for ``FirstTokenHold`` (the plugin's ``stats.py``), which moves
this work off the step that computes first tokens. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import statistics
import sys
import time

import msgspec
import prometheus_client as prom

from lmcache_svc_bench.vllm.engines import REPO

sys.path.insert(0, str(REPO / "connectors" / "vllm"))
from lmcache_svc_vllm import stats as st  # noqa: E402  (the plugin's, from this checkout)


class Recorder:
    """One counter per counter key and one histogram per timing, as the plugin's
    ``LMCacheSvcPromMetrics`` has them (labelled, one engine)."""

    def __init__(self) -> None:
        registry = prom.CollectorRegistry()
        self.counters = {
            n: prom.Counter(f"c_{n}", n, ["engine"], registry=registry).labels("0")
            for n in st.COUNTERS + st.HOOK_COUNTERS
        }
        self.histograms = {
            n: prom.Histogram(f"h_{n}", n, ["engine"], registry=registry).labels("0")
            for n in st.TIMINGS
        }

    def observe(self, data: dict) -> None:
        for name, counter in self.counters.items():
            if data.get(name):
                counter.inc(data[name])
        for name, histogram in self.histograms.items():
            for value in data.get(name, []):
                histogram.observe(value)


def hand_over(recorder: Recorder) -> float:
    """One hit step's stats from both halves to the recorder; microseconds."""
    worker, scheduler = st.StatsRecorder(), st.StatsRecorder()
    worker.add(load_chunks=47, load_bytes=12_320_768, load_in_place_chunks=47)
    worker.time("load_seconds", 0.001)
    worker.add_hook_time("worker", 120_000, 9)
    scheduler.add(lookups=1, lookup_query_tokens=6016, lookup_hit_tokens=6016)
    scheduler.time("lookup_seconds", 0.0002)
    scheduler.add_hook_time("scheduler", 150_000, 6)
    start = time.perf_counter()
    from_worker = pickle.loads(pickle.dumps(worker.take()))  # worker -> engine core
    merged = st.merge(from_worker, scheduler.take() or {})
    received = msgspec.msgpack.decode(msgspec.msgpack.encode(merged))  # -> front end
    st.merge(st.empty(), received)  # the log line's accumulator
    recorder.observe(received)
    return (time.perf_counter() - start) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--idle", type=float, default=1.3)
    args = parser.parse_args()
    recorder = Recorder()
    for _ in range(5):
        hand_over(recorder)
    warm = [hand_over(recorder) for _ in range(50 * args.repeats)]
    cold = []
    for _ in range(args.repeats):
        time.sleep(args.idle)
        cold.append(hand_over(recorder))
    print(
        json.dumps(
            {
                "host": f"{platform.processor() or platform.machine()}, {platform.release()}",
                "warm_us_median": round(statistics.median(warm), 1),
                "after_idle_us_median": round(statistics.median(cold), 1),
                "after_idle_us": [round(c) for c in cold],
                "idle_s": args.idle,
            }
        )
    )


if __name__ == "__main__":
    main()

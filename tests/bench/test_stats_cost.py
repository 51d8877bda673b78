"""``python -m lmcache_svc_bench.stats_cost`` runs and prints its figures (structure only,
never timings), and the replayed hand-over really reaches the counters."""

from __future__ import annotations

import json
import subprocess
import sys

from lmcache_svc_bench.stats_cost import Recorder, hand_over


def test_a_hand_over_reaches_the_counters_and_histograms() -> None:
    recorder = Recorder()
    assert hand_over(recorder) > 0
    assert recorder.counters["load_chunks"]._value.get() == 47
    assert recorder.counters["lookups"]._value.get() == 1
    assert recorder.counters["hook_calls"]._value.get() == 15  # both halves' calls
    assert recorder.histograms["load_seconds"]._sum.get() == 0.001


def test_the_script_prints_one_json_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lmcache_svc_bench.stats_cost", "--repeats", "2", "--idle", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert len(figures["after_idle_us"]) == 2 and figures["warm_us_median"] > 0

"""``bench hitcost``: the phases read off one request's marks, the copy baselines (the cold
copy's bytes and blocks, both targets' verdicts), and the quick mode end to end on real
vLLM engines (structure and sanity only, never timings)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from lmcache_svc_bench import hitcost
from lmcache_svc_bench.hitcost import _phase_times
from lmcache_svc_bench.hitcost_copy import (
    ColdCopy,
    CopyBaselines,
    KVGeometry,
    bench_geometry,
    cold_copy_ms,
    engine_cache_tokens,
    outside_target,
)
from lmcache_svc_bench.report import Report
from lmcache_svc_bench.runner import BenchContext, run_benchmark
from lmcache_svc_bench.stats import Gap
from lmcache_svc_bench.vllm.bench_model import TINY
from lmcache_svc_bench.vllm.engines import VLLM_PYTHON
from lmcache_svc_bench.vllm.rounds import rotated, round_queries
from lmcache_svc_bench.vllm_common import kv_bytes_per_token
from lmcache_svc_bench.vllm_ttft import Sample, Setup
from tests.helpers import import_plugin_from_source

SMALL = KVGeometry(num_layers=2, page_bytes=8, num_blocks=16, blocks_per_chunk=2)


def _sample(ttft_ms: float, num_cached_tokens: int, marks: list[tuple[float, str]]) -> Sample:
    return Sample(ttft_ms / 1e3, [], num_cached_tokens, marks)


def test_a_request_splits_into_phases_in_order() -> None:
    marks = [
        (0.0, "ttft.add"), (1.0, "get_num_new_matched_tokens>"),
        (1.2, "get_num_new_matched_tokens<"), (1.5, "build_connector_meta>"),
        (3.5, "bind_connector_metadata>"), (4.0, "start_load_kv>"),
        (5.5, "layers>"), (5.6, "wait_for_layer_load>"), (9.0, "wait_for_layer_load>"),
        (20.0, "wait_for_save>"), (22.0, "ttft.first"),
    ]  # fmt: skip
    assert _phase_times(_sample(22.0, 512, marks)) == pytest.approx([1.0, 0.5, 2.0, 2.0, 14.5, 2.0])
    # A request without the connector's marks (vLLM's own engine) has no phases.
    assert _phase_times(_sample(20.0, 512, [(0.0, "ttft.add"), (20.0, "ttft.first")])) is None


def test_the_cold_copy_fills_unused_blocks_with_the_chunks_pages_as_the_mover_does() -> None:
    cold = ColdCopy(SMALL, 3)
    assert cold.num_bytes == 3 * SMALL.chunk_bytes == 96
    assert all(not kv.any() for kv in cold.layers)  # zeroed once
    cold.chunks[...] = (np.arange(96) + 1).reshape(cold.chunks.shape)  # every byte its own
    # Up from block 1 (0 is vLLM's null block), then down through the next unused blocks,
    # then (past the last run that fits) from block 1 again.
    assert cold.block_ids(0) == [1, 2, 3, 4, 5, 6]
    assert cold.block_ids(1) == [12, 11, 10, 9, 8, 7]
    assert cold.block_ids(2) == [1, 2, 3, 4, 5, 6]
    for i in (0, 1):
        cold.copy(i)
        ids = cold.block_ids(i)
        for layer, kv in enumerate(cold.layers):
            for c in range(3):
                for j in range(2):  # chunk c's j-th block of this layer -> its block
                    assert kv[ids[2 * c + j]].tolist() == cold.chunks[c, layer, j].tolist()
    written = {b for i in (0, 1) for b in cold.block_ids(i)}
    for kv in cold.layers:  # exactly the bytes of the chunks, nowhere else
        assert int(np.count_nonzero(kv)) == len(written) * SMALL.page_bytes
        assert not kv[[b for b in range(16) if b not in written]].any()


def test_the_cold_copy_sleeps_the_idle_time_before_each_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[object] = []
    monkeypatch.setattr(ColdCopy, "copy", lambda self, i: events.append(("copy", i)))
    times = cold_copy_ms(SMALL, 2, idle_s=1.3, repeats=3, sleep=events.append)
    assert events == [1.3, ("copy", 0), 1.3, ("copy", 1), 1.3, ("copy", 2)]
    assert len(times) == 3 and all(t >= 0 for t in times)


def test_the_cold_destination_is_the_engines_cache_and_the_copy_the_loaded_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    per_token = kv_bytes_per_token(TINY)
    g = bench_geometry(per_token, TINY.num_layers, 128, 128, 524_288)
    assert (g.page_bytes, g.num_blocks, g.blocks_per_chunk) == (128 * per_token // 4, 4096, 1)
    assert g.cache_bytes == 1 << 30  # VLLM_CPU_KVCACHE_SPACE=1, as the engines have
    calls: list[tuple[int, float, int]] = []

    def fake(geometry: KVGeometry, num_chunks: int, *, idle_s: float, repeats: int) -> list:
        calls.append((num_chunks, idle_s, repeats))
        return [1.0] * repeats

    monkeypatch.setattr(hitcost, "cold_copy_ms", fake)
    runs = {
        583: [_sample(15.0, n, []) for n in (512, 512, 384)],
        6064: [_sample(47.0, n, []) for n in (6016, 5888, 6016)],
        9: [_sample(1.0, 0, [])],  # nothing loaded: no cold copy
    }
    out = hitcost._cold_copies(SimpleNamespace(progress=lambda _: None), g, runs, 7)
    assert calls == [(4, hitcost.IDLE_S, 7), (47, hitcost.IDLE_S, 7)] and list(out) == [583, 6064]
    # Byte for byte what the warm baseline counts: (b)'s median cached tokens x KV per token.
    assert 47 * g.chunk_bytes == 6016 * per_token and 4 * g.chunk_bytes == 512 * per_token
    with pytest.raises(ValueError, match="not whole blocks"):
        bench_geometry(per_token, TINY.num_layers, 128, 200, 524_288)


def test_the_cache_size_is_read_from_the_engines_log(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text(
        "INFO 11-26 [kv_cache_utils.py:1] CPU KV cache size: 524,288 tokens, Maximum "
        "concurrency for 8,192 tokens per request: 64.00x\n"
    )
    assert engine_cache_tokens(log) == 524_288
    log.write_text("INFO no such line\n")
    assert engine_cache_tokens(log) is None


def _report_of(b_ttft_6064: float) -> Report:
    """A report of two contexts: (c) at 14 / 45 ms, (b) at 14.5 ms and ``b_ttft_6064``, (b)'s
    copy in the engine 1.3 ms; warm memcpy at 22 GB/s, cold copies of 0.1-0.4 and 1.6-1.8 ms."""

    def runs(ttft: float, cached: int, marks: list[tuple[float, str]]) -> list[Sample]:
        return [_sample(ttft, cached, marks) for _ in range(3)]

    copy = [(5.0, "load.located"), (6.3, "load.copied")]
    samples = {
        name: {583: runs(14.0, 512, []), 6064: runs(45.0, 6016, [])} for name in "c cn cp".split()
    }
    samples["b"] = {583: runs(14.5, 512, copy), 6064: runs(b_ttft_6064, 6016, copy)}
    g = bench_geometry(2048, 4, 128, 128, 524_288)
    cold = {583: [0.3, 0.1, 0.4], 6064: [1.8, 1.6, 1.7]}
    report = Report("hitcost", "full")
    hitcost._write(report, samples, CopyBaselines(2048, 22.0, g, cold, 1.3))
    return report


@pytest.mark.parametrize(
    ("b_ttft_6064", "warm_met", "cold_met", "cold_context", "cold_excess"),
    [
        (47.5, False, True, 6064, 2.5 - 1.7),  # beyond memcpy, within the cold copy
        (48.5, False, False, 6064, 3.5 - 1.7),  # beyond both
        (46.5, True, True, 583, 0.5 - 0.3),  # within both; the cold worst is the other context
    ],
)
def test_both_baselines_give_their_own_verdict(
    b_ttft_6064: float, warm_met: bool, cold_met: bool, cold_context: int, cold_excess: float
) -> None:
    report = _report_of(b_ttft_6064)
    warm_ms = 6016 * 2048 / 22e9 * 1e3
    warm, cold = report.targets
    excess = b_ttft_6064 - 45.0 - warm_ms  # the same in every pair: a point interval
    assert warm.name == (
        f"(b) - (c), paired median, beyond the memcpy time of the loaded KV ({warm_ms:.2f} ms "
        f"at 22.0 GB/s, same run), worst context (6064; 90% interval {excess:.2f} to "
        f"{excess:.2f}), ms"
    )
    assert warm.value == pytest.approx(excess)
    assert cold.name.startswith("(b) - (c), paired median, beyond the cold copy time")
    cold_ms = {583: 0.3, 6064: 1.7}[cold_context]
    assert f"({cold_ms:.2f} ms:" in cold.name and "1024 MiB cache idle 1.3 s" in cold.name
    assert "median of 3" in cold.name
    assert f"worst context ({cold_context}; 90% interval {cold_excess:.2f} to " in cold.name
    assert cold.value == pytest.approx(cold_excess)
    assert (warm.met, cold.met) == (warm_met, cold_met)
    rows = report.to_markdown().split("### Targets")[1]
    assert rows.count("| met") + rows.count("| MISSED") == 2
    assert ("| MISSED" in rows) == (not (warm_met and cold_met))


def test_every_engine_runs_once_in_every_place_over_four_queries_or_rounds() -> None:
    orders = [rotated(hitcost.ENGINES, i) for i in range(8)]
    assert orders[0] == ("c", "cn", "cp", "b") and orders[1] == ("cn", "cp", "b", "c")
    assert orders[4:] == orders[:4]
    for place in range(4):
        assert sorted(o[place] for o in orders[:4]) == sorted(hitcost.ENGINES)
    assert all(sorted(o) == sorted(hitcost.ENGINES) for o in orders)


@pytest.mark.parametrize("rounds, num_queries", [(1, 5), (2, 2), (3, 41), (3, 11), (4, 4)])
def test_the_rounds_share_out_every_query_once_in_order(rounds: int, num_queries: int) -> None:
    shares = [round_queries(r, rounds, num_queries) for r in range(rounds)]
    assert [i for share in shares for i in share] == list(range(num_queries))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.parametrize("rounds", ["0", "3"])
def test_rounds_outside_one_to_the_queries_are_refused_before_anything_starts(
    tmp_path: Path, rounds: str
) -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} is missing: run scripts/setup_vllm.sh first")
    with pytest.raises(
        ValueError, match=rf"engine_rounds must be 1 to num_queries \(2\), got {rounds}"
    ):
        run_benchmark("hitcost", quick=True, out_dir=tmp_path, options={"engine_rounds": rounds})
    assert not list(tmp_path.rglob("engine-*.log"))  # no engine was started


@pytest.mark.parametrize(
    ("options", "switched"),
    [
        ({"pretouch_loads": "true"}, {"pretouch_loads": True}),
        ({"pretouch_loads": "false"}, {}),
        ({"overlap_loads": "false"}, {"overlap_loads": False}),
        ({"overlap_loads": "true", "pretouch_loads": "1"}, {"pretouch_loads": True}),
        ({}, {}),
    ],
)
def test_set_switches_reach_bs_plugin_alone(
    tmp_path: Path, options: dict[str, str], switched: dict[str, bool]
) -> None:
    """``--set pretouch_loads=true`` and ``--set overlap_loads=false`` (the A/Bs' switches)
    change the option in (b)'s connector config, as the plugin parses it, and nowhere else;
    a value equal to the plugin's default is left out of the config."""
    import_plugin_from_source()
    from lmcache_svc_vllm.config import ConnectorConfig, parse_config

    ctx = BenchContext("hitcost", True, tmp_path, tmp_path, lambda _: None, options)
    setup = Setup(tmp_path, tmp_path, "/run/sidecar.sock", None, lambda _: None)
    strategies = hitcost.strategies(setup, hitcost.plugin_settings(ctx))
    assert [s.name for s in strategies] == list(hitcost.ENGINES)
    # vLLM's own cache, the contexts run first, everywhere but in (b), which loads them
    assert [(s.prefix_caching, s.contexts_first) for s in strategies] == [(True, True)] * 3 + [
        (False, False)
    ]
    configs = {s.name: s.kv_config for s in strategies}
    assert configs["c"] is None and configs["cn"] == hitcost.NOOP_CONNECTOR
    b, cp = (configs[name] for name in ("b", "cp"))
    assert b is not None and cp is not None
    b_config, cp_config = (parse_config(x["kv_connector_extra_config"]) for x in (b, cp))
    assert (b_config.tenant, b_config.url) == ("b", "/run/sidecar.sock")
    defaults = ConnectorConfig()
    for key in ("pretouch_loads", "overlap_loads"):
        assert getattr(b_config, key) is switched.get(key, getattr(defaults, key)), key
        assert (key in b["kv_connector_extra_config"]) is (key in switched), key
        assert getattr(cp_config, key) is getattr(defaults, key), key


def _noisy_report(b_minus_c: list[float]) -> Report:
    """(c) at 45 ms and (b) at 45 + each of ``b_minus_c``, one context (6064); warm memcpy
    at 22 GB/s, cold copies of 0.5 ms."""
    samples = {
        name: {6064: [_sample(45.0, 6016, []) for _ in b_minus_c]} for name in ("c", "cn", "cp")
    }
    samples["b"] = {6064: [_sample(45.0 + d, 6016, []) for d in b_minus_c]}
    g = bench_geometry(2048, 4, 128, 128, 524_288)
    report = Report("hitcost", "full")
    hitcost._write(report, samples, CopyBaselines(2048, 22.0, g, {6064: [0.5] * 3}, 1.3))
    return report


def test_the_paired_median_comes_with_its_interval_and_a_miss_says_if_noise_covers_it() -> None:
    # Noisy pairs: the median (2.0) beyond the cold copy (0.5) misses 1 ms, but the
    # median's interval reaches down below the goal.
    noisy = [-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    report = _noisy_report(noisy)
    row_b = next(r for r in report.tables[0].rows if r[1] == "(b)")
    assert row_b[3] == pytest.approx(2.0)
    low, high = (float(x) for x in row_b[4].split(" to "))
    assert low < 2.0 < high and low >= -3.0 and high <= 7.0
    cold = report.targets[1]
    assert not cold.met and cold.value == pytest.approx(1.5)
    assert cold.why_missed.startswith(
        f"within the noise: the median's interval reaches {low - 0.5:.2f} ms"
    )
    # Steady pairs at the same median: the interval lies above the goal.
    steady = _noisy_report([1.9, 2.0, 2.0, 2.0, 2.1] * 2 + [2.0]).targets[1]
    assert not steady.met and steady.why_missed.startswith(
        "beyond the noise: the median's interval starts at 1.50 ms"
    )


def test_a_control_pair_off_zero_leaves_the_targets_not_evaluated() -> None:
    """(cn) - (c) far from 0 (a host that treats the engines differently): whatever (b)
    shows, no verdict is given."""
    samples = {
        "c": {6064: [_sample(120.0, 6016, []) for _ in range(5)]},
        "cn": {6064: [_sample(52.0 + i, 6016, []) for i in range(5)]},
        "cp": {6064: [_sample(50.0, 6016, []) for _ in range(5)]},
        "b": {6064: [_sample(100.0, 6016, []) for _ in range(5)]},  # "faster" than (c)
    }
    g = bench_geometry(2048, 4, 128, 128, 524_288)
    report = Report("hitcost", "full")
    hitcost._write(report, samples, CopyBaselines(2048, 22.0, g, {6064: [0.5] * 3}, 1.3))
    assert len(report.targets) == 2
    for target in report.targets:
        assert target.value < 1.0 and not target.met  # the value alone would have met it
        assert target.not_evaluated.startswith("the control pair (cn) - (c) is -66.00 ms")
        assert target.to_markdown_row()[3].startswith("NOT EVALUATED: the control pair")
    # A control within 1 ms of 0 leaves the verdicts to the values.
    samples["cn"] = {6064: [_sample(120.0 + d, 6016, []) for d in (-0.5, 0.0, 0.2, 0.4, 0.3)]}
    report = Report("hitcost", "full")
    hitcost._write(report, samples, CopyBaselines(2048, 22.0, g, {6064: [0.5] * 3}, 1.3))
    assert all(t.met and not t.not_evaluated for t in report.targets)


def test_outside_the_forward_pass_the_layers_spread_leaves_the_hooks_cost() -> None:
    # (cn) and (b) on the same six queries: the layers take 10-60 ms in turn, alike on
    # both engines only by chance; outside them (b) takes 0.5 ms more on every query
    # (the sixth has no marks in (b): not a pair).
    def marks(forward_ms: float, outside_ms: float) -> list[tuple[float, str]]:
        at = outside_ms - 1.0  # the phases before the layers; the output phase 1 ms
        return [
            (0.2, "get_num_new_matched_tokens>"), (0.4, "build_connector_meta>"),
            (0.6, "bind_connector_metadata>"), (at, "layers>"),
            (at + forward_ms, "wait_for_save>"), (at + forward_ms + 1.0, "ttft.first"),
        ]  # fmt: skip

    def runs(forwards: list[float], outside_ms: float) -> list[Sample]:
        return [_sample(f + outside_ms, 512, marks(f, outside_ms)) for f in forwards]

    cn = runs([10.0, 20.0, 30.0, 40.0, 50.0, 60.0], 3.0)
    b = runs([50.0, 10.0, 40.0, 20.0, 30.0], 3.5)
    b.append(_sample(99.0, 512, []))  # no marks: no pair
    cp = [_sample(25.0, 512, [])] * 6  # no marks at all: no row
    report = Report("hitcost", "full")
    hitcost._outside_forward(report, {"cn": {583: cn}, "cp": {583: cp}, "b": {583: b}})
    (table,) = report.tables
    ((context, engine, outside, gap, interval, p25, p75, pairs),) = table.rows
    assert (context, engine, pairs) == (583, "(b)", 5)
    assert outside == pytest.approx(3.5)
    assert (gap, p25, p75) == pytest.approx((0.5, 0.5, 0.5))
    assert interval == "0.50 to 0.50"  # whole TTFTs paired: -39.5 to +40.5 ms


def test_the_hooks_cost_outside_the_layers_is_judged_beyond_the_copy_before_them() -> None:
    # (b)'s copy ran in start_load_kv (before the layers: counted outside them) at 583,
    # beside the layers at 6064 (not counted there, so no allowance for it).
    def load_marks(copied_ms: float) -> list[tuple[float, str]]:
        return [(4.0, "start_load_kv>"), (4.1, "load.located"), (4.1 + copied_ms, "load.copied")]

    in_caller = _sample(50.0, 512, [*load_marks(0.3), (4.5, "start_load_kv<")])
    beside = _sample(180.0, 6016, [*load_marks(1.4), (4.4, "start_load_kv<")])
    assert hitcost._caller_copy_ms(in_caller) == pytest.approx(0.3)
    assert hitcost._caller_copy_ms(beside) == 0.0
    assert hitcost._caller_copy_ms(_sample(40.0, 512, [])) == 0.0  # no load at all
    gaps = {583: Gap.of([1.2, 1.3, 1.3, 1.3, 1.4]), 6064: Gap.of([1.1, 1.2, 1.2, 1.2, 1.3])}
    report = Report("hitcost", "full")
    outside_target(report, gaps, {583: 0.3, 6064: 0.0})
    (target,) = report.targets
    assert target.name.startswith(
        "(b) - (cn) outside the forward pass, paired median, beyond the copy that ran before "
        "the layers (0.00 ms, (b)'s own, median), worst context (6064; 90% interval"
    )
    assert target.value == pytest.approx(1.2) and not target.met
    assert target.why_missed.startswith("beyond the noise")
    report = Report("hitcost", "full")
    outside_target(report, {583: gaps[583]}, {583: 0.4})
    assert report.targets[0].met and report.targets[0].value == pytest.approx(0.9)


def test_the_copy_table_puts_the_engines_copy_next_to_both_baselines() -> None:
    report = _report_of(47.5)
    table = report.tables[-1]
    assert table.columns[2:] == [
        "(b)'s copy in the engine",
        "warm memcpy",
        "cold copy: median",
        "min",
        "max",
    ]
    (r583, r6064) = table.rows
    assert r6064[:2] == [6064, 6016 * 2048 / 1e6]
    assert r6064[2:] == pytest.approx([1.3, 6016 * 2048 / 22e9 * 1e3, 1.7, 1.6, 1.8])
    assert r583[4:] == pytest.approx([0.3, 0.1, 0.4])
    data = report.data["copy_baselines"]
    assert data["cold_cache_bytes"] == 1 << 30 and data["idle_s"] == 1.3
    assert data["contexts"]["6064"]["bytes"] == 6016 * 2048
    assert data["contexts"]["6064"]["cold_copy_runs_ms"] == [1.8, 1.6, 1.7]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_quick_mode_end_to_end(tmp_path: Path) -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} is missing: run scripts/setup_vllm.sh first")
    report = run_benchmark("hitcost", quick=True, out_dir=tmp_path)
    ttfts, phases, outside, copies = report.tables
    assert [(r[0], r[1]) for r in ttfts.rows] == [
        (583, "(c)"),
        (583, "(cn)"),
        (583, "(cp)"),
        (583, "(b)"),
    ]
    for row in ttfts.rows:
        assert math.isfinite(row[2]) and row[2] > 0
        assert row[7] == 512  # every engine served the context's whole chunks from a cache
    assert ttfts.rows[0][3] == 0  # (c) minus itself
    assert [r[1] for r in phases.rows] == ["(cn)", "(cp)", "(b)"]
    for row in phases.rows:
        assert all(v >= 0 for v in row[2:]) and sum(row[2:-1]) <= row[-1] + 1
    assert [(r[0], r[1], r[-1]) for r in outside.rows] == [(583, "(cp)", 2), (583, "(b)", 2)]
    for row, phase_row in zip(outside.rows, phases.rows[1:]):
        # TTFT less the forward pass: the phase table's other phases, query by query.
        assert 0 < row[2] < phase_row[-1] and math.isfinite(row[3])
    ((context, loaded_mb, engine, warm, cold, low, high),) = copies.rows
    assert (context, loaded_mb) == (583, 512 * 2048 / 1e6)
    assert all(math.isfinite(v) and v > 0 for v in (engine, warm, cold))
    assert low <= cold <= high
    assert len(report.data["copy_baselines"]["contexts"]["583"]["cold_copy_runs_ms"]) == 3
    # Each engine's first hit, on the warm-up context, came before the measured queries.
    first_hits = report.data["first_hits"]
    assert {n: [h["cached_tokens"] for h in hits] for n, hits in first_hits.items()} == {
        n: [512] for n in ("c", "cn", "cp", "b")
    }
    queries = report.data["queries"]["b"]["583"]
    assert len(queries) == 2 and all(q["marks"] and q["ttft_ms"] > 0 for q in queries)
    warm_target, cold_target, outside_target = report.targets
    assert "memcpy" in warm_target.name and "cold copy" in cold_target.name
    assert outside_target.name.startswith("(b) - (cn) outside the forward pass")
    assert all(math.isfinite(t.value) for t in report.targets)

"""Smoke test of ``bench lookup`` in quick mode: structure and sanity, never timings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lmcache_svc_bench.lookup import (
    HANDLER_ROW,
    INDEX_ROW,
    SERVER_ROW,
    SHAPES,
    expected_hits,
    prompt_hashes,
    synthetic_hash,
)
from lmcache_svc_bench.runner import run_benchmark


def test_prompt_shapes_hit_where_they_say() -> None:
    indexed = {synthetic_hash(i) for i in range(1000)}
    for shape in SHAPES:
        hashes = prompt_hashes(shape, 1000)
        assert len(hashes) == 128
        hits = 0
        while hits < len(hashes) and hashes[hits] in indexed:
            hits += 1
        assert hits == expected_hits(shape)


def test_unknown_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown prompt shape"):
        prompt_hashes("half hit", 1000)


def test_bad_sizes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="index sizes"):
        run_benchmark("lookup", quick=True, out_dir=tmp_path, options={"sizes": "10"})


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_mode(tmp_path: Path) -> None:
    report = run_benchmark(
        "lookup", quick=True, out_dir=tmp_path, options={"sizes": "2000,20000", "iters": "50"}
    )
    data = json.loads((tmp_path / "lookup.json").read_text())
    assert (tmp_path / "lookup.md").read_text().startswith("## bench lookup (quick)")
    assert set(data["data"]["sizes"]) == {"2000", "20000"}
    table, by_chunk = report.tables
    # One 32k-token prompt as 256-, 128- and 16-token chunks: more chunks, more to look up.
    assert [row[:2] for row in by_chunk.rows] == [[256, 128], [128, 256], [16, 2048]]
    assert all(math.isfinite(v) and v > 0 for row in by_chunk.rows for v in row[2:])
    assert by_chunk.rows[2][2] > by_chunk.rows[0][2]  # server-side: 2,048 keys vs 128
    paths = {row[1] for row in table.rows}
    assert {
        "server-side (cache.lookup)",
        "unix socket round trip",
        "tcp gRPC round trip",
        "REST round trip",
        INDEX_ROW,
        "baseline: dict lookup of 128 keys",
        "baseline: gRPC health check (unix socket)",
    } <= paths
    # 2 sizes x (5 paths and the server's handler mean x 3 shapes + 3 baselines)
    assert len(table.rows) == 2 * (6 * len(SHAPES) + 3)
    for row in table.rows:
        p50, p99 = row[3], row[4]
        assert row[6] > 0
        if row[1] == HANDLER_ROW:
            assert p99 == "-" and math.isfinite(p50) and p50 > 0
        else:
            assert math.isfinite(p50) and 0 < p50 <= p99
        if row[1] == SERVER_ROW:
            assert 0 < row[5] < math.inf
    assert [t.name.split(" at ")[0] for t in report.targets] == [
        "lookup p99 server-side",
        "lookup p99 round trip over the Unix socket",
    ]
    # each target is the worst p99 over the prompt shapes at the largest index, from the table
    largest = [row for row in table.rows if row[0] == "20,000"]
    server_side, round_trip = report.targets
    assert server_side.value == max(row[4] for row in largest if row[1] == SERVER_ROW)
    socket_p99 = max(row[4] for row in largest if row[1] == "unix socket round trip")
    assert round_trip.value == socket_p99
    assert (server_side.goal, round_trip.goal) == (1.0, 2.0)
    assert server_side.why_missed.startswith("its on-CPU p99 is ")
    assert round_trip.why_missed.startswith("a bare gRPC health check on the same channel")

"""``bench soak``: a short run with every fault, and the checks that make it fail."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from lmcache_svc_bench.redis_procs import redis_server_path
from lmcache_svc_bench.runner import run_benchmark
from lmcache_svc_bench.soak import OPS, PHASES
from lmcache_svc_bench.soak_worker import Tally, Worker, content, prefix_hashes, soak_namespace


class _NoClient:
    def register_namespace(self, ns: object) -> bytes:
        return b"\0" * 16


def test_the_verifier_counts_wrong_bytes(tmp_path: Path) -> None:
    """The control: a chunk with one flipped byte, or another key's bytes, is a mismatch."""
    ns = soak_namespace()
    a, b = prefix_hashes(ns, 0)[:2]
    assert content(a, 1024) == content(a, 1024) != content(b, 1024)
    tally = Tally(tmp_path / "t.json")
    worker = Worker(_NoClient(), False, False, 8, tally)  # type: ignore[arg-type]
    good = content(a, ns.chunk_bytes)
    flipped = bytearray(good)
    flipped[12345] ^= 1
    worker.verify(a, good)
    worker.verify(a, bytes(flipped))
    worker.verify(a, content(b, ns.chunk_bytes))
    counts: Counter[str] = sum(tally.seconds.values(), start=Counter())
    assert counts["mismatches"] == 2 and counts["bytes_verified"] == ns.chunk_bytes
    assert tally.mismatched == [a.hex(), a.hex()]


def test_bad_parameters_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="minutes"):
        run_benchmark("soak", quick=True, out_dir=tmp_path, options={"minutes": "0.01"})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_short_soak_serves_no_wrong_bytes_through_every_fault(tmp_path: Path) -> None:
    if redis_server_path() is None:
        pytest.skip("redis-server is not on PATH (CI's set-up installs it)")
    report = run_benchmark("soak", quick=True, out_dir=tmp_path, options={"minutes": "0.75"})
    data = report.data
    assert data["mismatches"] == 0, data["totals"]["mismatched"]
    assert not data["failed"] and data["pending_stores"] == 0
    for name in PHASES:  # operations happened in each phase, faults or not
        counts = data["totals"]["phases"][name]
        assert all(counts.get(op, 0) > 0 for op in OPS), (name, counts)
        assert counts.get("bytes_verified", 0) > 0, (name, counts)
    events = {what for _, what in data["events"]}
    assert {"client SIGKILL", "redis SIGSTOP", "redis SIGKILL", "server SIGKILL",
            "server SIGTERM"} <= events  # fmt: skip
    assert data["totals"]["final"]["chunks"] > 0
    assert "| final check |" in (tmp_path / "soak.md").read_text()


def test_cli_passes_minutes_and_exits_1_on_a_failed_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lmcache_svc_bench.runner as runner
    from lmcache_svc.cli import main
    from lmcache_svc_bench.report import Report

    seen: dict[str, str] = {}

    def finished(name: str, **kwargs: Any) -> Report:
        seen.update(kwargs["options"])
        report = Report(name, "full")
        report.data["failed"] = outcome
        return report

    monkeypatch.setattr(runner, "run_benchmark", finished)
    outcome = False
    assert main(["bench", "soak", "--minutes", "2", "--out", str(tmp_path)]) == 0
    assert seen == {"minutes": "2.0"}
    outcome = True
    assert main(["bench", "soak", "--out", str(tmp_path)]) == 1

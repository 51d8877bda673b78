"""The GPU check script's two-process arena path, run on the CPU so it cannot rot unseen
(its CUDA stream, page-locking, HBM IPC and benchmarks run only on a GPU machine)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the GPU check needs torch (the [torch] extra)")

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_arena_round_trip_dry_run_on_cpu() -> None:
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "bytes identical" in out.stdout

"""``lmcache-svc`` where the benchmarks are not installed (the server image, a client
install): ``serve`` and ``stats`` are unaffected, ``bench`` names the install command and
exits 2. The child process hides ``lmcache_svc_bench`` as an interpreter without it would."""

from __future__ import annotations

import subprocess
import sys

HIDE_BENCHMARKS = "import sys; sys.modules['lmcache_svc_bench'] = None; "


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    code = HIDE_BENCHMARKS + f"from lmcache_svc.cli import main; sys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_bench_without_the_benchmarks_says_how_to_install_them() -> None:
    out = run_cli("bench", "dataplane", "--quick")
    assert out.returncode == 2, out.stderr
    assert "not installed" in out.stderr and "pip install ./benchmarks" in out.stderr


def test_the_other_commands_work_without_the_benchmarks() -> None:
    out = run_cli("serve", "--help")
    assert out.returncode == 0, out.stderr
    assert "--cpu-bytes" in out.stdout
    out = run_cli("--help")
    assert out.returncode == 0 and "bench" in out.stdout


def test_bench_with_the_benchmarks_lists_them() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lmcache_svc", "bench", "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "dataplane" in out.stdout and "workload" in out.stdout

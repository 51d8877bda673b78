"""The unexpected-skip check (``-p tests.skip_check``) on a tiny test file, in a real pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.skip_check import EXPECTED_SKIPS, is_expected

ROOT = Path(__file__).resolve().parents[1]


def run_pytest(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest with the check on ``test_tiny.py`` (``body``) and ``test_other.py`` (one pass)."""
    (tmp_path / "test_tiny.py").write_text("import pytest\n\n" + textwrap.dedent(body))
    (tmp_path / "test_other.py").write_text("def test_other_passes():\n    pass\n")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.skip_check", "-p", "no:cacheprovider",
         "-q", "-rs", str(tmp_path), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_an_unexpected_skip_fails_the_run_and_names_the_test(tmp_path: Path) -> None:
    out = run_pytest(
        tmp_path,
        """
        def test_passes(): pass
        def test_needs_a_tool(): pytest.skip("frobnicator is not on PATH")
        """,
    )
    assert out.returncode == 1, out.stdout
    assert "test_tiny.py::test_needs_a_tool: frobnicator is not on PATH" in out.stdout
    assert "2 passed, 1 skipped" in out.stdout


def test_a_module_skipped_unexpectedly_fails_the_run(tmp_path: Path) -> None:
    out = run_pytest(tmp_path, 'pytest.importorskip("no_such_module_here")\ndef test_x(): pass\n')
    assert out.returncode == 1 and "1 passed, 1 skipped" in out.stdout, out.stdout
    assert "test_tiny.py: could not import 'no_such_module_here'" in out.stdout


def test_expected_skips_deselection_and_xfail_pass(tmp_path: Path) -> None:
    out = run_pytest(
        tmp_path,
        """
        @pytest.mark.skipif(True, reason="needs CUDA (not available here)")
        def test_on_a_gpu(): pass
        def test_as_root(): pytest.skip("root writes through directory permissions")
        @pytest.mark.xfail(reason="a known bug")
        def test_known_bug(): assert False
        def test_not_selected(): pytest.skip("frobnicator is not on PATH")
        """,
        "-k",
        "not test_not_selected",
    )
    assert out.returncode == 0, out.stdout
    assert "1 passed, 2 skipped, 1 deselected, 1 xfailed" in out.stdout
    assert "unexpected skips" not in out.stdout


def test_a_failure_keeps_its_exit_code(tmp_path: Path) -> None:
    out = run_pytest(tmp_path, "def test_fails(): assert False\n")
    assert out.returncode == 1 and "unexpected skips" not in out.stdout


def test_reasons_match_by_prefix() -> None:
    assert is_expected("needs CUDA (not available here)")
    assert is_expected("needs a CUDA device")
    assert not is_expected("redis-server is not on PATH (CI's set-up installs it)")
    assert not is_expected("a reason that needs CUDA")  # the prefix, not anywhere
    assert all(why for why in EXPECTED_SKIPS.values())

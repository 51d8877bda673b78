"""Fails a run in which a test skips for a reason nobody expects.

Loaded with ``-p tests.skip_check`` (``scripts/test.sh``, so CI, does; a plain ``pytest``
run does not). A skipped test is expected when its reason starts with one of the prefixes
in ``EXPECTED_SKIPS``; any other skip (a missing tool or venv, a fixture that gave up) means
the run did not test what it should, so the session exits non-zero and names each such test
with its reason. Tests deselected with ``-k`` or ``-m`` are not skips, and xfails are not
checked. ``docs/testing.md`` says how to declare a new expected reason.
"""

from __future__ import annotations

import pytest

EXPECTED_SKIPS: dict[str, str] = {
    # reason prefix -> why a run may skip for it
    "needs CUDA": "GPU tests (tests/cuda_marks.py's NEEDS_CUDA) on a machine without a GPU",
    "needs a CUDA device": "tests/vllm/test_layout.py's CUDA page layout, without a GPU",
    "needs an x86-64 Linux host with AMX": (
        "tests/bench/test_engine_site.py's AMX permission check on a host without AMX"
    ),
    "root writes through directory permissions": (
        "tests/tiers/test_ssd.py's unwritable-directory case means nothing as root"
    ),
}


def is_expected(reason: str) -> bool:
    return any(reason.startswith(prefix) for prefix in EXPECTED_SKIPS)


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str | None:
    """The reason of a skip report (the text given to ``pytest.skip`` or ``skipif``)."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    message = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return message.removeprefix("Skipped: ")


class SkipCheck:
    def __init__(self) -> None:
        self.unexpected: list[tuple[str, str]] = []  # (test id, reason)

    def _record(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        reason = skip_reason(report)
        if reason is not None and not is_expected(reason):
            self.unexpected.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)  # a whole module skipped (importorskip, skip at module level)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.unexpected and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.unexpected:
            return
        terminalreporter.section("unexpected skips", red=True)
        for nodeid, reason in self.unexpected:
            terminalreporter.line(f"{nodeid}: {reason}", red=True)
        terminalreporter.line(
            f"{len(self.unexpected)} test(s) skipped for a reason not in "
            "tests/skip_check.py's EXPECTED_SKIPS: the run fails (see docs/testing.md)"
        )


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SkipCheck(), "lmcache-svc-skip-check")

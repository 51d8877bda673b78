"""``lmcache-svc bench`` stopped with SIGTERM (a ``kill``, a job's timeout) stops the servers
it started and removes its scratch directory, as Ctrl-C does; Python's default ended the
process at once and left them running."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers import child_pids, process_state, wait_until

SCRATCH = re.compile(r"scratch in (\S+);")


def test_sigterm_stops_the_benchmarks_servers_and_removes_its_scratch(tmp_path: Path) -> None:
    # an index of 10^6 chunks takes far longer to fill than the server takes to start
    bench = subprocess.Popen(
        [sys.executable, "-m", "lmcache_svc", "bench", "lookup", "--quick"]
        + ["--out", str(tmp_path), "--set", "sizes=1000000"],
        stderr=subprocess.PIPE,
        text=True,
    )
    servers: list[int] = []

    def server_started() -> bool:
        assert bench.poll() is None, "the benchmark ended before its server started"
        servers[:] = child_pids(bench.pid, named=b"serve")
        return bool(servers)

    try:
        assert bench.stderr is not None
        match = SCRATCH.search(bench.stderr.readline())
        assert match, "the benchmark did not say where its scratch directory is"
        scratch = Path(match.group(1))
        wait_until(server_started, 60, "the benchmark's server start")
        bench.send_signal(signal.SIGTERM)
        code = bench.wait(60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        left = [pid for pid in servers if process_state(pid) not in (None, "Z")]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert (code, left, scratch.exists()) == (128 + signal.SIGTERM, [], False)

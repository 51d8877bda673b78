"""``lmcache-svc bench`` stopped with SIGTERM (a ``kill``, a job's timeout) stops the servers
it started and removes its scratch directory, as Ctrl-C does; Python's default ended the
process at once and left them running."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRATCH = re.compile(r"scratch in (\S+);")


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # a thread that just ended
            continue
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_stops_the_benchmarks_servers_and_removes_its_scratch(tmp_path: Path) -> None:
    # an index of 10^6 chunks takes far longer to fill than the server takes to start
    bench = subprocess.Popen(
        [sys.executable, "-m", "lmcache_svc", "bench", "lookup", "--quick"]
        + ["--out", str(tmp_path), "--set", "sizes=1000000"],
        stderr=subprocess.PIPE,
        text=True,
    )
    servers: list[int] = []
    try:
        assert bench.stderr is not None
        match = SCRATCH.search(bench.stderr.readline())
        assert match, "the benchmark did not say where its scratch directory is"
        scratch = Path(match.group(1))
        deadline = time.monotonic() + 60
        while not servers:
            assert bench.poll() is None, "the benchmark ended before its server started"
            assert time.monotonic() < deadline, "no server started within 60 s"
            servers = [
                c
                for c in children(bench.pid)
                if b"serve" in Path(f"/proc/{c}/cmdline").read_bytes()
            ]
            time.sleep(0.05)
        bench.send_signal(signal.SIGTERM)
        code = bench.wait(60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        left = [pid for pid in servers if alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert (code, left, scratch.exists()) == (128 + signal.SIGTERM, [], False)

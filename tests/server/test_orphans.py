"""Start-up clean-up on real servers: segments of killed servers go, live ones stay."""

from __future__ import annotations

from pathlib import Path

from lmcache_svc_bench.procs import ServerProc, start_server


def test_two_quick_kills_leave_no_orphan_and_the_live_server_keeps_its_segment(
    tmp_path: Path,
) -> None:
    live = start_server(tmp_path)
    killed: list[ServerProc] = []
    try:
        for _ in range(2):
            server = start_server(tmp_path)
            server.proc.kill()  # no clean-up: its freshly created segment stays
            server.proc.wait()
            killed.append(server)
        orphans = [Path("/dev/shm", s.shm) for s in killed]
        assert orphans[-1].exists()  # created after every clean-up so far
        third = start_server(tmp_path)
        try:
            assert not [p.name for p in orphans if p.exists()]
            assert Path("/dev/shm", live.shm).exists()
            assert Path("/dev/shm", third.shm).exists()
            assert "its server was killed" in third.log()
        finally:
            third.cleanup()
    finally:
        for server in killed:
            server.cleanup()
        live.cleanup()

"""The checked-in generated code is exactly what scripts/gen_proto.sh produces."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(ROOT / "scripts/gen_proto.sh"), str(tmp_path)],
        check=True,
        env={**os.environ, "PYTHON": sys.executable},
        timeout=120,
    )
    generated = sorted(p.name for p in (tmp_path / "lmcache_svc/v1").iterdir())
    checked_in = sorted(
        p.name
        for p in (ROOT / "lmcache_svc/v1").iterdir()
        if p.is_file() and p.suffix in (".py", ".pyi")
    )
    assert generated == checked_in
    for name in generated:
        fresh = (tmp_path / "lmcache_svc/v1" / name).read_text()
        assert fresh == (ROOT / "lmcache_svc/v1" / name).read_text(), (
            f"lmcache_svc/v1/{name} is stale: run scripts/gen_proto.sh"
        )

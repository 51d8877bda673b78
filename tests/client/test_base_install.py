"""The client needs only the base dependencies (grpcio, protobuf, numpy; pyproject.toml): a
process that can import nothing else outside the standard library stores and loads chunks
through a real server, over shared memory and inline."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from lmcache_svc_bench.procs import ServerProc, start_server

ROOT = Path(__file__).resolve().parents[2]


def _name(requirement: str) -> str:
    return re.split(r"[ ;<>=!~\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def base_distributions() -> set[str]:
    """The project's base dependencies (pyproject.toml) and what they require, recursively
    (no extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [_name(r) for r in project["dependencies"]]
    found: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            requires = metadata.requires(name) or []
            todo += [_name(r) for r in requires if "extra ==" not in r]
    return found


def base_modules() -> list[str]:
    """Top-level modules the base distributions install, and the package itself."""
    dists = base_distributions()
    installed = metadata.packages_distributions()
    mods = {m for m, ds in installed.items() if any(_name(d) in dists for d in ds)}
    return sorted(mods | {"lmcache_svc"})


# Every module outside the standard library and the base dependencies is blocked in the child.
GUARD = """
import importlib.abc, sys

ALLOWED = set(sys.stdlib_module_names) | set({allowed!r})
blocked = []  # (importer, module) where the importer is part of lmcache_svc

def importer():
    frame = sys._getframe(2)
    while frame is not None and "importlib" in frame.f_globals.get("__name__", "importlib"):
        frame = frame.f_back
    return "" if frame is None else frame.f_globals.get("__name__", "")

class OnlyBaseDependencies(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in ALLOWED and not top.startswith("_"):
            if importer().startswith("lmcache_svc"):
                blocked.append((importer(), name))
            raise ModuleNotFoundError(f"{{name}} is not a base dependency", name=name)
        return None

sys.meta_path.insert(0, OnlyBaseDependencies())
"""

USE_THE_CLIENT = """
from lmcache_svc.client import CacheClient, LookupResult
from lmcache_svc.keys import KVLayout, Namespace, chunk_hashes

layout = KVLayout("uint8", num_layers=1, num_kv_heads=1, head_size=64, block_size=16,
                  page_layout="test")
ns = Namespace(model="base-install", layout=layout, chunk_size=256)
chunks = [bytes([i]) * ns.chunk_bytes for i in range(3)]
hashes = chunk_hashes(ns, list(range(3 * 256)))
for use_shm in (True, False):
    with CacheClient({socket!r}, timeout_s=30, use_shm=use_shm) as client:
        client.wait_ready(30)
        assert client.shm_available is use_shm
        ns_id = client.register_namespace(ns)
        assert client.store(ns_id, hashes, chunks) == 3
        assert client.lookup(ns_id, hashes) == LookupResult(3, ["cpu"] * 3, ["host_memory"] * 3)
        assert client.load(ns_id, hashes) == chunks
        assert client.delete(ns_id, hashes) == 3
assert not blocked, blocked
print("ok")
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProc]:
    proc = start_server(tmp_path)
    yield proc
    proc.cleanup()


def run_guarded(code: str) -> subprocess.CompletedProcess[str]:
    script = GUARD.format(allowed=base_modules()) + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_the_allowed_modules_are_the_base_dependencies() -> None:
    assert {"grpcio", "protobuf", "numpy"} <= base_distributions()
    allowed = base_modules()
    assert {"grpc", "google", "numpy", "lmcache_svc"} <= set(allowed)
    for extra in ("fastapi", "uvicorn", "redis", "pydantic", "yaml", "xxhash", "grpc_health"):
        assert extra not in allowed


def test_the_guard_blocks_the_server_extras() -> None:
    out = run_guarded("import lmcache_svc.server.app")
    assert out.returncode != 0
    assert "is not a base dependency" in out.stderr


def test_the_client_works_with_the_base_dependencies_only(server: ServerProc) -> None:
    out = run_guarded(USE_THE_CLIENT.format(socket=server.socket))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

"""The cache's ownership rule (``lmcache_svc/cache/__init__.py``): ``FirstTierSlots`` owns the
chunk index and is the only code that changes it; every other part asks it."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import lmcache_svc
from lmcache_svc.cache.chunk_index import ChunkIndex
from lmcache_svc.cache.first_tier_slots import FirstTierSlots
from tests.caches import CacheFactory
from tests.helpers import make_namespace

PACKAGE = Path(lmcache_svc.__file__).parent
INDEX_MODULE = PACKAGE / "cache" / "chunk_index.py"
OWNER_MODULE = PACKAGE / "cache" / "first_tier_slots.py"


def _index_changes() -> set[str]:
    """``ChunkIndex`` methods that change it: those that check the lock (``_locked``), and
    those that call one of them."""
    (cls,) = (
        n
        for n in ast.parse(INDEX_MODULE.read_text()).body
        if isinstance(n, ast.ClassDef) and n.name == "ChunkIndex"
    )
    calls: dict[str, set[str]] = {}
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef):
            calls[fn.name] = {
                c.func.attr
                for c in ast.walk(fn)
                if isinstance(c, ast.Call)
                and isinstance(c.func, ast.Attribute)
                and isinstance(c.func.value, ast.Name)
                and c.func.value.id == "self"
            }
    changes = {name for name, called in calls.items() if "_locked" in called}
    while more := {n for n, called in calls.items() if called & changes} - changes:
        changes |= more
    return changes


def _receiver(node: ast.expr) -> str | None:
    """The last name of a call's receiver: ``index`` for ``self.slots.index.pin(...)``."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def _offences(path: Path, changes: set[str]) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Name | ast.Attribute) and _receiver(node) == "ChunkIndex":
            yield f"{where}: names ChunkIndex"
        if isinstance(node, ast.Attribute) and node.attr in ("_index", "on_change"):
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                yield f"{where}: reaches into another object's .{node.attr}"
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in changes
            and _receiver(node.func.value) in ("_index", "index", "chunk_index")
        ):
            yield f"{where}: calls {node.func.attr} on a chunk index"


def test_the_index_changes_are_found() -> None:
    """The rule below is only as good as this list: it holds the methods that change the
    index and none that only read it."""
    changes = _index_changes()
    assert {"reserve", "mark_ready", "pin", "unpin", "remove", "quarantine", "touch"} <= changes
    assert {"remove_for_demotion", "end_demotion", "rekey", "mark_deleted"} <= changes
    assert not changes & {"readable", "entry", "slot_of", "busy", "pending", "owned_bytes"}


def test_only_the_owner_changes_the_chunk_index() -> None:
    changes = _index_changes()
    offences = [
        offence
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in (INDEX_MODULE, OWNER_MODULE)
        for offence in _offences(path, changes)
    ]
    assert not offences, "\n".join(offences)


@pytest.fixture
def make_cache(tmp_path: Path) -> Iterator[CacheFactory]:
    with CacheFactory(64 * 1024, [make_namespace(chunk_size=256)], tmp_path) as factory:
        yield factory


def test_no_part_but_the_owner_holds_the_chunk_index(make_cache: CacheFactory) -> None:
    """Walk the cache's parts (two levels of attributes): the one ``ChunkIndex`` hangs off
    the ``FirstTierSlots``, nowhere else."""
    cache = make_cache(4, ssd_chunks=4)
    holders: list[str] = []
    seen: set[int] = set()

    def walk(obj: object, path: str, depth: int) -> None:
        if id(obj) in seen or depth > 3:
            return
        seen.add(id(obj))
        for name, value in getattr(obj, "__dict__", {}).items():
            if isinstance(value, ChunkIndex):
                holders.append(f"{path}.{name} ({type(obj).__name__})")
            elif type(value).__module__.startswith("lmcache_svc.cache"):
                walk(value, f"{path}.{name}", depth + 1)

    walk(cache, "cache", 0)
    assert len(holders) == 1, holders
    assert holders[0].endswith(f"._index ({FirstTierSlots.__name__})"), holders

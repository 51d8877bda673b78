"""Write pip constraints that pin each direct dependency of lmcache-svc to its declared floor.

    python floor_constraints.py OUT [--extras server ...]
    python floor_constraints.py --check OUT     (each pinned distribution is installed at its pin)

Reads pyproject.toml's ``dependencies`` and the named extras; a requirement with a lower
bound (``>=X``, ``~=X``, ``==X``) becomes ``name==X``; one without is an error, since nothing
would say which version its floor is. pip has no "lowest versions" resolution (uv's
``--resolution=lowest-direct``), so scripts/test_floors.sh installs with these constraints.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def floor_of(req: Requirement) -> str:
    lows = [s.version for s in req.specifier if s.operator in (">=", "~=", "==")]
    if len(lows) != 1:
        raise SystemExit(f"{req}: no single lower bound to pin (declare one with >=)")
    return f"{req.name}=={lows[0]}"


def check(path: str) -> None:
    """Exit non-zero unless every pinned distribution is installed at its pin."""
    pins = [line.strip().split("==") for line in open(path) if "==" in line]
    wrong = [
        f"{name} {metadata.version(name)} (floor {version})"
        for name, version in pins
        if Version(metadata.version(name)) != Version(version)
    ]
    if wrong:
        raise SystemExit(f"not at the declared floor: {', '.join(wrong)}")
    floors = ", ".join(f"{name} {version}" for name, version in pins)
    print(f"floors: Python {sys.version.split()[0]}, {floors}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--extras", nargs="*", default=[])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if args.check:
        check(args.out)
        return
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in args.extras:
        reqs += project["optional-dependencies"][extra]
    pins = sorted({floor_of(Requirement(r)) for r in reqs})
    Path(args.out).write_text("\n".join(pins) + "\n")
    print("\n".join(pins), file=sys.stderr)


if __name__ == "__main__":
    main()

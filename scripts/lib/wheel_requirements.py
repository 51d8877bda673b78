"""Write a wheel's Requires-Dist entries as a requirements file, minus some, with pins.

    python wheel_requirements.py WHEEL OUT [--skip NAME ...] [--pin NAME=SPEC ...]

Markers are evaluated for the running interpreter with no extra selected (so extras'
requirements drop out). ``--pin`` replaces the wheel's own specifier for that name (and is
added when the wheel does not ask for it). Used by setup_vllm.sh and setup_lmcache.sh to
install a package's dependencies without the ones that would drag in CUDA builds.
"""

from __future__ import annotations

import argparse
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("wheel")
    p.add_argument("out")
    p.add_argument("--skip", nargs="*", default=[])
    p.add_argument("--pin", nargs="*", default=[])
    args = p.parse_args()
    skip = {_norm(n) for n in args.skip}
    pins = {_norm(item.split("=", 1)[0]): item.split("=", 1)[1] for item in args.pin}
    with zipfile.ZipFile(args.wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    kept = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        name = _norm(req.name)
        if name in skip:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        kept.append(pins.pop(name, str(req)))
    kept += pins.values()
    with open(args.out, "w") as f:
        f.write("\n".join(kept) + "\n")
    print(f"{len(kept)} requirements kept", file=sys.stderr)


if __name__ == "__main__":
    main()

"""The ``lmcache-svc`` command: ``serve`` runs the server, ``stats`` asks a running one,
``bench`` runs the benchmarks (a distribution of their own, ``benchmarks/``: where it is not
installed, ``bench`` says how to install it and exits 2)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lmcache_svc.errors import ConfigError, LMCacheSvcError

BENCH_INSTALL = "pip install ./benchmarks (in a checkout of lmcache-svc; see docs/benchmarks.md)"

# flag -> dotted config key
_SERVE_FLAGS: dict[str, tuple[str, str]] = {
    "--host": ("host", "address of the TCP listeners (default 127.0.0.1)"),
    "--http-port": ("http_port", "REST port (0 = any free port)"),
    "--grpc-port": ("grpc_port", "gRPC TCP port (0 = any free port)"),
    "--socket": ("socket", "gRPC Unix socket path"),
    "--cpu-bytes": ("cpu.capacity", "size of the shared-memory arena, e.g. 4GiB"),
    "--shm-name": ("cpu.shm_name", "name of the segment under /dev/shm"),
    "--prefault": ("cpu.prefault", "off | background | sync"),
    "--ssd-path": ("ssd.path", "directory of the SSD tier (enables it)"),
    "--ssd-bytes": ("ssd.capacity", "capacity of the SSD tier, e.g. 100GiB"),
    "--memory-path": ("memory.path", "directory where named memories persist"),
    "--memory-bytes": ("memory.capacity", "capacity for named memories, e.g. 4GiB"),
    "--redis-url": ("redis.url", "Redis URL (enables the Redis tier)"),
    "--redis-bytes": ("redis.capacity", "capacity of the Redis tier"),
    "--log-level": ("log_level", "debug | info | warning | error"),
    "--ready-file": ("ready_file", "write a JSON line with the bound addresses here when ready"),
}
_SERVE_SWITCHES: dict[str, tuple[str, Any, str]] = {
    "--no-http": ("http_port", None, "no REST listener"),
    "--no-grpc-tcp": ("grpc_port", None, "gRPC on the Unix socket only"),
    "--no-socket": ("socket", None, "gRPC on TCP only"),
    "--redis-cluster": ("redis.cluster", True, "the Redis URL points at a Redis Cluster"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmcache-svc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the cache server")
    serve.add_argument("--config", help="YAML or TOML config file (env: LMCACHE_SVC_CONFIG)")
    for flag, (_, text) in _SERVE_FLAGS.items():
        serve.add_argument(flag, help=text)
    for flag, (_, _, text) in _SERVE_SWITCHES.items():
        serve.add_argument(flag, action="store_true", help=text)
    stats = sub.add_parser("stats", help="print the tiers' state of a running server")
    stats.add_argument(
        "--url", help="server address: socket path or host:port (default: the default socket path)"
    )
    stats.add_argument("--json", action="store_true", help="print JSON")
    stats.add_argument("--timeout", type=float, default=5.0)
    _add_bench(sub)
    return parser


def _benchmarks() -> dict[str, tuple[str, str]] | None:
    """The benchmarks' table (name -> module, description), or None where the benchmarks
    are not installed (the server image, a client install)."""
    try:
        from lmcache_svc_bench import BENCHMARKS
    except ModuleNotFoundError as e:
        if e.name != "lmcache_svc_bench":
            raise
        return None
    return BENCHMARKS


def _add_bench(sub: Any) -> None:
    benchmarks = _benchmarks()
    if benchmarks is None:
        missing = sub.add_parser("bench", help="run benchmarks (not installed here)")
        missing.add_argument("args", nargs=argparse.REMAINDER)
        return
    names = "\n".join(f"  {name:<10} {text}" for name, (_, text) in benchmarks.items())
    bench = sub.add_parser(
        "bench",
        help="run benchmarks (figures next to same-run baselines)",
        description=f"benchmarks:\n{names}\n  all        every one of them, in this order",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("names", nargs="+", metavar="NAME", choices=[*benchmarks, "all"])
    bench.add_argument("--quick", action="store_true", help="about two minutes each (smoke)")
    bench.add_argument("--out", default="bench-results", help="directory for JSON, markdown, PNG")
    bench.add_argument("--keep-work", action="store_true", help="keep the scratch directory")
    bench.add_argument(
        "--minutes", type=float, help="length of the run (soak; same as --set minutes=N)"
    )
    bench.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one of a benchmark's parameters (see docs/benchmarks.md)",
    )


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for flag, (key, _) in _SERVE_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out[key] = value
    for flag, (key, value, _) in _SERVE_SWITCHES.items():
        if getattr(args, flag[2:].replace("-", "_")):
            out[key] = value
    return out


def _serve(args: argparse.Namespace) -> int:
    import os

    from lmcache_svc.config import load_config
    from lmcache_svc.server.app import serve

    path = args.config or os.environ.get("LMCACHE_SVC_CONFIG")
    config = load_config(path, overrides=_overrides(args))
    serve(config)
    return 0


def _stats(args: argparse.Namespace) -> int:
    from lmcache_svc.client import CacheClient, default_address

    with CacheClient(args.url or default_address(), timeout_s=args.timeout, use_shm=False) as c:
        stats = c.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(
        f"lmcache-svc {stats['version']}: {stats['active_leases']} leases, "
        f"{stats['pending_stores']} pending stores, {stats['num_namespaces']} namespaces"
    )
    print(f"{'tier':<8} {'used':>12} {'capacity':>12} {'use':>6} {'chunks':>9}")
    for t in stats["tiers"]:
        use = t["used_bytes"] / t["capacity_bytes"] if t["capacity_bytes"] else 0.0
        print(
            f"{t['name']:<8} {_size(t['used_bytes']):>12} {_size(t['capacity_bytes']):>12} "
            f"{use:>6.1%} {t['num_chunks']:>9}"
        )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    benchmarks = _benchmarks()
    if benchmarks is None:
        print(f"lmcache-svc bench: not installed here: {BENCH_INSTALL}", file=sys.stderr)
        return 2
    from lmcache_svc_bench.report import targets_at_a_glance
    from lmcache_svc_bench.runner import run_benchmark

    options: dict[str, str] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"lmcache-svc bench: --set wants KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        options[key] = value
    if args.minutes is not None:
        options["minutes"] = str(args.minutes)
    names = list(benchmarks) if "all" in args.names else args.names
    reports = []
    for name in names:
        report = run_benchmark(
            name,
            quick=args.quick,
            out_dir=Path(args.out),
            keep_work=args.keep_work,
            options=options,
        )
        print(report.to_markdown(), flush=True)
        reports.append(report)
    if len(reports) > 1:
        glance = targets_at_a_glance(reports)
        (Path(args.out) / "targets.md").write_text(glance)
        print(glance, flush=True)
    unjudged = sum(bool(t.not_evaluated) for r in reports for t in r.targets)
    missed = sum(not t.met and not t.not_evaluated for r in reports for t in r.targets)
    failed = sum(bool(r.data.get("failed")) for r in reports)
    if missed:
        print(f"{missed} target(s) missed: see the reports in {args.out}", file=sys.stderr)
    if unjudged:
        print(f"{unjudged} target(s) not evaluated: see the reports in {args.out}", file=sys.stderr)
    if failed:  # a correctness check failed (soak: wrong bytes served), not a speed target
        print(f"{failed} benchmark(s) failed a correctness check", file=sys.stderr)
        return 1
    return 0


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{n} B"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        commands = {"serve": _serve, "stats": _stats, "bench": _bench}
        return commands[args.command](args)
    except ConfigError as e:
        print(f"lmcache-svc: {e}", file=sys.stderr)
        return 2
    except LMCacheSvcError as e:
        print(f"lmcache-svc: {e.kind}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

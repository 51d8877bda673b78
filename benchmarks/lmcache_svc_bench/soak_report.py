"""The named-memory part of the ``bench soak`` report: operations per phase and the final
check, from the memory workers' counts (``soak_memories.py``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from lmcache_svc_bench.report import Report

COLUMNS = ["phase", "puts", "reads", "lists", "deletes", "errors", "MiB verified",
           "corrupted, refused", "mismatches"]  # fmt: skip


def memory_table(
    report: Report, phases: tuple[str, ...], bounds: dict[str, tuple[float, float]],
    totals: dict[str, Any],
) -> tuple[int, int]:  # fmt: skip
    """Add the table; (memories served with wrong bytes, bytes of memory reads verified)."""
    table = report.table("Named memories per phase (2 workers: gRPC and REST)", COLUMNS)
    mismatches = verified = 0
    errors_by_kind: Counter[str] = Counter()
    for name in phases:
        counts = totals["phases"][name]
        errors = {k[10:]: v for k, v in counts.items() if k.startswith("mem_error:")}
        errors_by_kind.update(errors)
        mismatches += counts.get("mem_mismatches", 0)
        verified += counts.get("mem_bytes_verified", 0)
        began, ended = bounds[name]
        table.add(name, *(counts.get(op, 0) for op in ("mem_put", "mem_get", "mem_list",
                  "mem_delete")), sum(errors.values()), counts.get("mem_bytes_verified", 0)
                  / 2**20, counts.get("mem_corrupted_refused", 0),
                  counts.get("mem_mismatches", 0))  # fmt: skip
    final = totals["memories_final"]
    mismatches += final["mismatches"]
    table.add("final check", 0, final["memories"], 1, 0, 0, final["bytes_verified"] / 2**20,
              final["corrupted_refused"], final["mismatches"])  # fmt: skip
    table.notes += [
        "errors by kind: " + (", ".join(f"{k} {v}" for k, v in errors_by_kind.most_common())
                              or "none"),
        f"memory files corrupted on disk during the run: {final['files_corrupted']} (a read "
        "of one is refused as memory_corrupted and the file quarantined; a put stores it "
        "again)",
    ]  # fmt: skip
    return mismatches, verified

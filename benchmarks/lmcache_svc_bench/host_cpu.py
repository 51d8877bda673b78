"""How much of a run's CPU time the hypervisor took away ("steal" in ``/proc/stat``).

On a virtual machine the hypervisor may run other guests on this guest's CPUs while it has
work; the kernel counts that time as steal. Timings taken meanwhile stretch by whatever
the hypervisor took, unevenly: on 2026-11-28 a `bench ttft` run on a host losing 11-41% of
its busy time (`vmstat`, five seconds in its last round) saw vLLM's own prefix hit take
89-260 ms across one cell's queries (median 201, above the 160 of computing the whole
prompt). The runner reports the share with the machine, and a run over ``MAX_STEAL``
does not judge its timing targets (``Report.judge_host``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MAX_STEAL = 0.05
"""The share of the busy CPU time stolen above which a run's timings are not judged."""

_PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """The machine's CPU time so far, in clock ticks, from the first line of ``/proc/stat``."""

    busy: int  # user, nice, system, irq and softirq time (guests' time is in user's)
    steal: int

    @classmethod
    def read(cls, path: Path = _PROC_STAT) -> CpuTimes | None:
        """Now's times, or None where the file is missing or not Linux's layout."""
        try:
            with path.open() as f:
                fields = f.readline().split()
        except OSError:
            return None
        if len(fields) < 9 or fields[0] != "cpu" or not all(v.isdigit() for v in fields[1:9]):
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
        return cls(user + nice + system + irq + softirq, steal)


def steal_share(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    """Of the time the CPUs had work between the two readings, the share the hypervisor
    ran something else; None when either reading is missing or nothing ran."""
    if before is None or after is None:
        return None
    busy, steal = after.busy - before.busy, after.steal - before.steal
    if busy < 0 or steal < 0 or busy + steal == 0:
        return None
    return steal / (busy + steal)

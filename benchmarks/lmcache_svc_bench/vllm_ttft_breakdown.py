"""Where a hit's time to first token goes: ``bench ttft``'s per-phase table.

Every engine of the benchmark runs with ``LMCACHE_SVC_VLLM_TRACE`` (``trace.py`` in the
plugin): the runner marks each ``LLMEngine.step`` and the first token, the plugin marks
each connector hook's entry and exit and the phases inside the load and the save. From one
request's marks (``Sample.marks``, up to its first token) this module takes:

- steps: ``step()`` calls up to the first token (a deferred lookup costs one more);
- lookup: from the scheduler's first ``get_num_new_matched_tokens`` to the answer (given
  inside that hook where the server's lookup index can tell, else by the lookup thread);
  deferred: scheduler steps that went on without it;
- load: ``start_load_kv``, split into finding the chunks (the lease, a ``prepare_load``
  round trip, or, reading in place, the lookup index; both after a read in place that had
  to be redone) and the copies into vLLM's blocks (a load copied beside the forward pass,
  ``overlap_loads``: the hand-over in the hook and the forward pass's waits for its layers);
- save: ``wait_for_save``, split into waiting for the slot reservation and the copies;
- other hooks: the rest of the plugin's hook time (both halves);
- vLLM: everything outside the plugin's hooks (scheduling, the forward pass, the engine's
  process hops), to compare with (c)'s whole TTFT.

The marks cost a few microseconds each (one ``write`` per mark), a few dozen per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lmcache_svc_bench.report import Report
from lmcache_svc_bench.stats import GAP_LEVEL, Gap, median
from lmcache_svc_bench.vllm_ttft import Cell, Results, Sample

Marks = Sequence[tuple[float, str]]


@dataclass(frozen=True)
class Breakdown:
    """One request's phases, in ms (counts for ``steps`` and ``deferred``)."""

    ttft: float
    steps: int
    lookup: float
    deferred: int
    load_lease: float
    load_copy: float
    save_wait: float
    save_copy: float
    other_hooks: float

    @property
    def plugin(self) -> float:
        """The plugin's time on the request's path (its hooks)."""
        return self.load_lease + self.load_copy + self.save_wait + self.save_copy + self.other_hooks

    @property
    def vllm(self) -> float:
        return self.ttft - self.plugin


def until_first(marks: Marks) -> list[tuple[float, str]]:
    out = []
    for ms, name in marks:
        out.append((ms, name))
        if name == "ttft.first":
            break
    return out


def hook_spans(marks: Marks) -> dict[str, list[tuple[float, float]]]:
    """(entry, exit) in ms per hook name, from the ``name>`` / ``name<`` marks."""
    open_at: dict[str, float] = {}
    spans: dict[str, list[tuple[float, float]]] = {}
    for ms, name in marks:
        if name.endswith(">") and name != "step>":
            open_at[name[:-1]] = ms
        elif name.endswith("<") and name != "step<" and name[:-1] in open_at:
            hook = name[:-1]
            spans.setdefault(hook, []).append((open_at.pop(hook), ms))
    return spans


def first_mark(marks: Marks, name: str, after: float = 0.0) -> float | None:
    """The time of the first mark ``name`` at or after ``after`` (None: there is none)."""
    return next((ms for ms, n in marks if n == name and ms >= after), None)


def _between(marks: Marks, span: tuple[float, float], first: str, second: str) -> float:
    """ms from ``first`` to ``second`` (or to the span's end) inside one hook span."""
    lo, hi = span
    start = first_mark(marks, first, lo) if first else lo
    end = first_mark(marks, second, start or lo) if second else hi
    if start is None or start > hi:
        return 0.0
    return (min(end, hi) if end is not None else hi) - start


def _load_parts(
    marks: Marks, span: tuple[float, float], waits: Sequence[tuple[float, float]]
) -> tuple[float, float]:
    """(finding the chunks, copying them) in ms for one ``start_load_kv`` span: the copy
    starts at the last ``load.acquired`` or ``load.located`` before ``load.copied``. A load
    copied beside the forward pass (``overlap_loads``: ``load.copied`` only after the span)
    copies from its last find to the span's end (the hand-over) and while the forward pass
    waits for its layers (``waits``: the ``wait_for_layer_load`` spans after it)."""
    lo, hi = span
    inside = [(ms, n) for ms, n in marks if lo <= ms <= hi]
    copied = next((ms for ms, n in inside if n == "load.copied"), None)
    found = [ms for ms, n in inside if n in ("load.acquired", "load.located")]
    if copied is None:
        if not found or first_mark(marks, "load.copied", hi) is None:
            return hi - lo, 0.0
        return found[-1] - lo, hi - found[-1] + sum(b - a for a, b in waits)
    found = [ms for ms in found if ms <= copied]
    start = found[-1] if found else lo
    return start - lo, copied - start


def _waits_after(
    loads: Sequence[tuple[float, float]], waits: Sequence[tuple[float, float]]
) -> list[list[tuple[float, float]]]:
    """For each load span, the layer waits between its end and the next load's start."""
    ends = [hi for _, hi in loads]
    starts = [lo for lo, _ in loads[1:]] + [float("inf")]
    return [[w for w in waits if end <= w[0] < nxt] for end, nxt in zip(ends, starts)]


def breakdown(sample: Sample) -> Breakdown:
    marks = until_first(sample.marks)
    spans = hook_spans(marks)
    total = sum(b - a for s in spans.values() for a, b in s)
    loads, saves = spans.get("start_load_kv", []), spans.get("wait_for_save", [])
    waits = _waits_after(loads, spans.get("wait_for_layer_load", []))
    parts = [_load_parts(marks, s, w) for s, w in zip(loads, waits)]
    load_lease = sum(p[0] for p in parts)
    load_copy = sum(p[1] for p in parts)
    save_wait = sum(_between(marks, s, "", "save.reserved") for s in saves)
    save_copy = sum(_between(marks, s, "save.reserved", "save.copied") for s in saves)
    asked = first_mark(marks, "get_num_new_matched_tokens>")
    answered = first_mark(marks, "lookup.answered")
    return Breakdown(
        ttft=sample.ttft_s * 1e3,
        steps=sum(1 for _, n in marks if n == "step>"),
        lookup=answered - asked if asked is not None and answered is not None else 0.0,
        deferred=sum(1 for _, n in marks if n == "lookup.deferred"),
        load_lease=load_lease,
        load_copy=load_copy,
        save_wait=save_wait,
        save_copy=save_copy,
        other_hooks=total - load_lease - load_copy - save_wait - save_copy,
    )


def median_breakdown(samples: Sequence[Sample]) -> Breakdown:
    parts = [breakdown(s) for s in samples]

    def med(name: str) -> float:
        return median([float(getattr(p, name)) for p in parts])

    return Breakdown(
        ttft=med("ttft"),
        steps=round(med("steps")),
        lookup=med("lookup"),
        deferred=round(med("deferred")),
        load_lease=med("load_lease"),
        load_copy=med("load_copy"),
        save_wait=med("save_wait"),
        save_copy=med("save_copy"),
        other_hooks=med("other_hooks"),
    )


def traced(results: dict[str, Results]) -> bool:
    return any(s.marks for res in results.values() for samples in res.values() for s in samples)


def breakdown_table(
    report: Report, results: dict[str, Results], cells: list[Cell], name: str = "b"
) -> dict[Cell, Breakdown]:
    """The per-phase table of ``name`` next to (c) and (d); the medians per cell."""
    others = [n for n in ("c", "d") if n in results]
    columns = ["context", "query", f"({name}) TTFT", "steps", "lookup", "deferred"]
    columns += ["load: lease or index", "load: copy", "save: wait", "save: copy", "other hooks"]
    columns += [f"({name}) outside hooks", *(f"({n}) TTFT" for n in others)]
    columns += [f"({n}) steps" for n in others]
    table = report.table(f"Where ({name})'s time to first token goes (median ms per cell)", columns)
    out: dict[Cell, Breakdown] = {}
    for cell in cells:
        b = out[cell] = median_breakdown(results[name][cell])
        row: list[object] = [cell[0], cell[1], b.ttft, b.steps, b.lookup, b.deferred]
        row += [b.load_lease, b.load_copy, b.save_wait, b.save_copy, b.other_hooks, b.vllm]
        row += [median_breakdown(results[n][cell]).ttft for n in others]
        row += [median_breakdown(results[n][cell]).steps for n in others]
        table.add(*row)
    table.notes += [
        "From the time marks of the runner and the plugin (trace.py), up to the first token; "
        "each column the median over the cell's queries (so the parts need not add up).",
        "lookup: the scheduler's first get_num_new_matched_tokens to the answer: on the "
        "scheduler's thread, inside that hook (so also in other hooks), where the server's "
        "lookup index answers (same host); else on the lookup thread, off the engine's path "
        "unless it is deferred. load: start_load_kv, finding "
        "the chunks (the lease, prepare_load, or reading in place the lookup index) then the "
        "copies into vLLM's blocks (copied beside the forward pass: the hand-over and the "
        "forward pass's waits for the layers). save: wait_for_save, the wait for "
        "the slots reserved during the forward pass then the copies out. other hooks: the "
        "plugin's remaining hook time, both halves. outside hooks: TTFT minus the plugin's "
        "hooks (vLLM's scheduling, forward pass and process hops).",
    ]
    return out


def memcpy_gbps(num_bytes: int = 64 << 20, repeats: int = 5) -> float:
    """This host's memcpy bandwidth (numpy copy between two warm buffers, best of
    ``repeats``): the same-run baseline for the copies of a load."""
    import time

    import numpy as np

    src = np.ones(num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best / 1e9


def fixed_cost_target(
    report: Report,
    results: dict[str, Results],
    cells: list[Cell],
    kv_bytes_per_token: int,
    gbps: float,
    name: str = "b",
) -> None:
    """(b) - (c) per cell against 1 ms plus the time memcpy takes for the bytes (b) loaded:
    what a hit costs beyond moving its KV, over vLLM's own prefix hit. (b) - (c) is the
    median of the per-query differences: the engines ran each query within seconds of each
    other (side by side), so a pair shares the host's drift, which two cells' medians
    taken apart do not."""

    def excess(cell: Cell) -> tuple[float, float, Gap]:
        gap = paired_gap(results[name][cell], results["c"][cell])
        loaded = median([float(s.num_cached_tokens) for s in results[name][cell]])
        copy_ms = loaded * kv_bytes_per_token / (gbps * 1e9) * 1e3
        return gap.median - copy_ms, copy_ms, gap

    worst = max(cells, key=lambda c: excess(c)[0])
    over, copy_ms, gap = excess(worst)
    report.target(
        f"({name}) - (c) TTFT beyond the memcpy time of the loaded KV ({copy_ms:.2f} ms at "
        f"{gbps:.1f} GB/s, same run), paired median of {len(gap.values)} queries, worst cell "
        f"(ctx {worst[0]}, q {worst[1]}; {GAP_LEVEL:.0%} interval of the pairs' median "
        f"{gap.low - copy_ms:.2f} to {gap.high - copy_ms:.2f}), ms",
        over,
        1.0,
        lower_is_better=True,
        why_missed="the per-phase table shows where the time goes",
    )


def paired_gap(samples: Sequence[Sample], base: Sequence[Sample]) -> Gap:
    """The per-query TTFT differences ``samples`` minus ``base`` in ms (query i with query
    i: the same prompt on two engines side by side)."""
    return Gap.of([(s.ttft_s - b.ttft_s) * 1e3 for s, b in _pairs(samples, base)])


def paired_ratio(samples: Sequence[Sample], base: Sequence[Sample]) -> Gap:
    """The per-query TTFT ratios ``samples`` over ``base`` (query i with query i), their
    median and its interval: a ratio that the host's drift between queries does not move,
    as it moves the ratio of two medians taken apart."""
    return Gap.of([s.ttft_s / b.ttft_s for s, b in _pairs(samples, base)])


def _pairs(samples: Sequence[Sample], base: Sequence[Sample]) -> list[tuple[Sample, Sample]]:
    if len(samples) != len(base):
        raise ValueError(f"pairs need as many samples: {len(samples)} and {len(base)}")
    return list(zip(samples, base))

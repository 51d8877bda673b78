"""``bench hitcost``: what a hit costs beyond vLLM's own prefix hit, measured in pairs.

On a small host the TTFT of the same request drifts by several milliseconds between runs,
more than the fixed cost this is after. Here (``bench ttft``'s driver,
``vllm_ttft.measure_side_by_side``) every engine is up at once and the requests alternate
between them, one at a time, so each query's TTFTs on the different engines are taken
within seconds of each other; and they are compared as pairs, with a control pair:

  c    vLLM's own prefix cache: the context run once in the engine, then each query hits it
  cn   the same with a KV connector that does nothing (``vllm/noop_connector.py``): what
       vLLM's connector machinery costs a hit, with no cache behind it
  cp   the same with the plugin: the query hits vLLM's own cache, the plugin looks up and
       saves alongside (what the plugin's presence costs a hit)
  b    a fresh engine, vLLM's prefix cache off, the context loaded from the server (a hit)

The engines take each query in a rotating order (the first query c, cn, cp, b; the next cn,
cp, b, c; ...), so no engine always runs first or right after another one. And the queries
are split into rounds (``--set engine_rounds=N``, 3 by default, 1 in ``--quick``): each round
starts every engine afresh, in an order rotated by the round, so no engine is always the
first one up. An engine process carries a bias of its own: on one host (2 vCPUs, Intel)
two identical plain engines differed by 2-4 ms at the median, and whichever was started
first was the slower one (both start orders tried). One fixed start order put that bias
into every pair with (c).

Between two requests the driver waits ``IDLE_S``: vLLM's shared-memory readers busy-loop for
a second after each read (``SpinCondition`` in vLLM's ``shm_broadcast.py``), and an engine
that just ran would take the CPU from the next one. So each request finds its engine idle,
as a request to a quiet server does. Every engine runs with the plugin's time marks
(``trace.py``); the phases of (cn), (cp) and (b) come from them.

The target weighs (b) - (c) against 1 ms plus a copy of the bytes (b) loaded, measured in
the same run against two baselines (``hitcost_copy.py``), each with its verdict: a warm
memcpy, and a cold copy (the mover's copies into a destination as large as the engine's KV
cache, written once and left idle as the engines are before each query). (cn) - (c) is the
control: a no-op connector costs next to nothing, so when that pair is not within 1 ms of
0 the host, not the plugin, decides the pairs and the targets are not evaluated.

The layers' own time spreads from one request to the next by more than the fixed cost
(tens of milliseconds at a 953-token query on a 2-vCPU host), and they are the same work
with or without a connector. So (cp) and (b) are also paired against (cn) with each
TTFT's forward phase taken out (``_outside_forward``): the hooks' cost without that spread.
A third target weighs (b)'s against 1 ms, beyond (b)'s own copy where it ran before the
layers (``outside_target``; a copy beside them is not in this measure, so it earns nothing).

``--set pretouch_loads=true`` turns the plugin's ``pretouch_loads`` on in (b) alone (its
scheduler reads a page of the hit's chunks before the worker copies them), and ``--set
overlap_loads=false`` turns ``overlap_loads`` off (every layer copied before the forward
pass): an A/B is a run with the switch and a run without, each weighed against its own (c).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lmcache_svc_bench.hitcost_copy import (
    CopyBaselines,
    KVGeometry,
    bench_geometry,
    cold_copy_ms,
    copy_table,
    copy_targets,
    engine_cache_tokens,
    outside_target,
)
from lmcache_svc_bench.procs import start_server
from lmcache_svc_bench.report import Report
from lmcache_svc_bench.runner import BenchContext
from lmcache_svc_bench.stats import GAP_LEVEL, Gap, median, percentile
from lmcache_svc_bench.ttft import Params, make_workload
from lmcache_svc_bench.vllm.bench_model import Shape
from lmcache_svc_bench.vllm.engines import EngineProc
from lmcache_svc_bench.vllm.rounds import IDLE_S, check_rounds
from lmcache_svc_bench.vllm_common import (
    BLOCK_SIZE,
    KV_CACHE_GIB,
    kv_bytes_per_token,
    make_model,
    require_vllm,
    shape_named,
    wait_for_commits,
)
from lmcache_svc_bench.vllm_ttft import (
    PLUGIN_DEFAULT_CHUNK,
    Results,
    Sample,
    Setup,
    Strategy,
    measure_side_by_side,
    plugin_config,
    write_contexts,
)
from lmcache_svc_bench.vllm_ttft_breakdown import first_mark, memcpy_gbps, paired_gap
from lmcache_svc_bench.vllm_ttft_report import first_hits_data, first_hits_note

ENGINES = ("c", "cn", "cp", "b")
NOOP_CONNECTOR = {
    "kv_connector": "NoopConnector",
    "kv_connector_module_path": "noop_connector",
    "kv_role": "kv_both",
}
# Phases of one request from its marks: (name, first mark, second mark), each searched
# after the previous phase's end.
PHASES = (
    ("scheduling", "", "get_num_new_matched_tokens>"),
    ("lookup", "get_num_new_matched_tokens>", "build_connector_meta>"),
    ("to the worker", "build_connector_meta>", "bind_connector_metadata>"),
    ("load, to layer 1", "bind_connector_metadata>", "layers>"),
    ("forward", "layers>", "wait_for_save>"),
    ("output", "wait_for_save>", "ttft.first"),
)
FORWARD = [name for name, _, _ in PHASES].index("forward")


def run(ctx: BenchContext) -> Report:
    require_vllm()
    quick = ctx.quick
    p = Params(
        model=ctx.option("model", "tiny"),
        contexts=tuple(int(x) for x in str(ctx.option("contexts", _contexts(quick))).split(",")),
        queries=(ctx.option("query", 167),),
        num_queries=ctx.option("num_queries", 2 if quick else 11),
        max_tokens=8,
        chunk_size=None,
        strategies=("a",),
        seed=ctx.option("seed", 0),
    )
    p.check()
    cold_repeats = ctx.option("cold_repeats", 3 if quick else 7)
    rounds = ctx.option("engine_rounds", 1 if quick else 3)
    b_settings = plugin_settings(ctx)
    check_rounds(rounds, p.num_queries)
    shape = shape_named(p.model)
    workload = make_workload(p)
    model_dir = make_model(ctx.work_dir, p.model)
    server = start_server(ctx.work_dir, "--cpu-bytes", "256MiB", "--prefault", "sync")
    cold = ColdCopies(ctx, shape, cold_repeats)
    try:
        setup = Setup(model_dir, ctx.work_dir, server.socket, None, ctx.progress)
        write_contexts(setup, workload, "b", plugin_config(setup, None, tenant="b"))
        num_chunks = sum(len(c) // PLUGIN_DEFAULT_CHUNK for c in workload.stored_contexts())
        wait_for_commits(server.socket, num_chunks)
        measured = measure_side_by_side(
            setup, workload, strategies(setup, b_settings), rounds, while_up=cold
        )
    finally:
        server.cleanup()
    samples = {name: by_context(res) for name, res in measured.results.items()}
    report = ctx.report()
    geometry = _geometry(shape, cold.logged_tokens)
    baselines = CopyBaselines(kv_bytes_per_token(shape), memcpy_gbps(), geometry, cold.ms, IDLE_S)
    _write(report, samples, baselines)
    report.tables[0].notes.append(first_hits_note(measured.first_hits))
    if b_settings:
        report.tables[0].notes.append(f"(b)'s plugin settings beyond the defaults: {b_settings}")
    report.data["copy_baselines"]["cache_tokens_logged"] = cold.logged_tokens
    report.data["params"] = {
        "contexts": p.contexts,
        "query": p.queries[0],
        "n": p.num_queries,
        "engine_rounds": rounds,
        "b_plugin_settings": b_settings,
    }
    report.data["mark_timeline_ms"] = _mark_timelines(samples)
    report.data["first_hits"] = first_hits_data(measured.first_hits)
    report.data["queries"] = {  # each query's TTFT and time marks, for a closer look
        name: {
            str(context): [
                {
                    "ttft_ms": round(s.ttft_s * 1e3, 3),
                    "marks": [[round(ms, 3), m] for ms, m in s.marks],
                }
                for s in runs
            ]
            for context, runs in by_context.items()
        }
        for name, by_context in samples.items()
    }
    return report


B_SWITCHES = {"pretouch_loads": False, "overlap_loads": True}
"""The plugin's switches ``--set`` can flip in (b), with the plugin's defaults."""


def plugin_settings(ctx: BenchContext) -> dict[str, Any]:
    """(b)'s plugin settings beyond the defaults, from ``--set`` (``B_SWITCHES``)."""
    settings = {key: ctx.option(key, default) for key, default in B_SWITCHES.items()}
    return {key: value for key, value in settings.items() if value != B_SWITCHES[key]}


def strategies(setup: Setup, b_settings: dict[str, Any]) -> list[Strategy]:
    """The engines in ``ENGINES``' order: (c), (cn), (cp) with vLLM's prefix cache, the
    contexts run first; (b) and (cp) the plugin under their own tenants, (b) with
    ``b_settings`` (``plugin_settings``) too."""
    kv_configs: dict[str, dict[str, Any] | None] = {
        "c": None,
        "cn": NOOP_CONNECTOR,
        "cp": plugin_config(setup, None, tenant="cp"),
        "b": plugin_config(setup, None, tenant="b", **b_settings),
    }
    return [
        Strategy(name, kv_configs[name], prefix_caching=name != "b", contexts_first=name != "b")
        for name in ENGINES
    ]


@dataclass
class ColdCopies:
    """``measure_side_by_side``'s ``while_up`` for hitcost: with the last round's engines up
    and idle, as before each query, ``repeats`` cold copies of what (b) loaded per context
    (``ms``), into a cache the size (b) logged (``logged_tokens``; None: it logged none)."""

    ctx: BenchContext
    shape: Shape
    repeats: int
    logged_tokens: int | None = None
    ms: dict[int, list[float]] = field(default_factory=dict)

    def __call__(self, engines: dict[str, EngineProc], results: dict[str, Results]) -> None:
        self.logged_tokens = engine_cache_tokens(engines["b"].log_path)
        geometry = _geometry(self.shape, self.logged_tokens)
        source = "as (b) logged" if self.logged_tokens else "configured; (b) logged none"
        self.ctx.progress(f"cold copies into a cache of {geometry.num_blocks} blocks ({source})")
        self.ms = _cold_copies(self.ctx, geometry, by_context(results["b"]), self.repeats)


def by_context(results: Results) -> dict[int, list[Sample]]:
    """One query length per run: the samples by context length."""
    return {cell[0]: samples for cell, samples in results.items()}


def _contexts(quick: bool) -> str:
    return "583" if quick else "583,6064"


def _geometry(shape: Shape, logged_tokens: int | None) -> KVGeometry:
    """(b)'s KV cache as its plugin sees it: the size vLLM logged (else the configured one)."""
    per_token = kv_bytes_per_token(shape)
    tokens = logged_tokens or KV_CACHE_GIB * 2**30 // per_token
    return bench_geometry(per_token, shape.num_layers, BLOCK_SIZE, PLUGIN_DEFAULT_CHUNK, tokens)


def _cold_copies(
    ctx: BenchContext, geometry: KVGeometry, runs: dict[int, list[Sample]], repeats: int
) -> dict[int, list[float]]:
    """Per context, ``repeats`` cold copies (ms) of the whole chunks (b) loaded (the median
    of its queries' cached tokens)."""
    out: dict[int, list[float]] = {}
    for context, samples in runs.items():
        tokens = round(median([float(s.num_cached_tokens) for s in samples]))
        num_chunks = tokens // PLUGIN_DEFAULT_CHUNK
        if num_chunks:
            ctx.progress(f"cold copy of {num_chunks} chunks ({context}), {repeats} times")
            out[context] = cold_copy_ms(geometry, num_chunks, idle_s=IDLE_S, repeats=repeats)
    return out


def _write(
    report: Report, samples: dict[str, dict[int, list[Sample]]], baselines: CopyBaselines
) -> None:
    table = report.table(
        "Median TTFT and paired differences (ms)",
        ["context", "engine", "TTFT", "minus (c): median", "its 90% interval", "p25", "p75"]
        + ["cached tokens"],
    )
    gaps: dict[int, Gap] = {}  # (b) - (c), paired, per context
    controls: dict[int, Gap] = {}  # (cn) - (c): the pairs' own error
    for context, base in samples["c"].items():
        for name in ENGINES:
            runs = samples[name][context]
            gap = paired_gap(runs, base)
            table.add(
                context,
                f"({name})",
                median([s.ttft_s * 1e3 for s in runs]),
                *_gap_cells(gap),
                median([float(s.num_cached_tokens) for s in runs]),
            )
            if name == "b":
                gaps[context] = gap
            elif name == "cn":
                controls[context] = gap
    table.notes += [
        "Each query ran on every engine in turn (in a rotating order), the engine idle before "
        "it, in rounds of fresh engines started in a rotated order (the run's params say how "
        "many); 'minus (c)' is the median (and quartiles) of the per-query differences to (c); "
        f"its interval, a {GAP_LEVEL:.0%} percentile bootstrap of that median (seeded).",
        "(c) prefix cache, no connector; (cn) + a no-op KV connector; (cp) + the plugin, "
        "hitting vLLM's own cache; (b) fresh engine, prefix cache off, loaded from the server.",
    ]
    _phases(report, samples)
    outside = _outside_forward(report, samples)
    loaded = {c: median([float(s.num_cached_tokens) for s in r]) for c, r in samples["b"].items()}
    engine_copies = {c: _median_copy_ms(r) for c, r in samples["b"].items()}
    warm, cold = copy_table(report, loaded, engine_copies, baselines)
    copy_targets(report, gaps, warm, cold, baselines, controls)
    caller_copies = {c: median([_caller_copy_ms(s) for s in r]) for c, r in samples["b"].items()}
    outside_target(report, outside, caller_copies)


def _median_copy_ms(runs: Sequence[Sample]) -> float | None:
    copies = [c for c in (_copy_ms(s) for s in runs) if c is not None]
    return median(copies) if copies else None


def _phases(report: Report, samples: dict[str, dict[int, list[Sample]]]) -> None:
    table = report.table(
        "Where each engine's time to first token goes (median ms)",
        ["context", "engine", *(name for name, _, _ in PHASES), "TTFT"],
    )
    for name in ("cn", "cp", "b"):
        for context, runs in samples[name].items():
            rows = [r for r in (_phase_times(s) for s in runs) if r is not None]
            if not rows:
                continue
            cols = [median([r[i] for r in rows]) for i in range(len(PHASES))]
            table.add(context, f"({name})", *cols, median([s.ttft_s * 1e3 for s in runs]))
    table.notes += [
        "From the time marks (trace.py; the no-op connector marks its hooks alike): "
        "scheduling, add_request to the connector's first question; lookup, to the step's "
        "plan; to the worker, the plan's trip to the worker process; load, the worker's "
        "hooks up to layer 1 (vLLM's input preparation; (b)'s load); forward, the layers; "
        "output, the rest (sampling, the trip back, the first token's delivery).",
    ]


def _outside_forward(report: Report, samples: dict[str, dict[int, list[Sample]]]) -> dict[int, Gap]:
    """(cp) and (b) against (cn), query by query, with the layers taken out of both TTFTs;
    (b)'s gaps by context.

    The layers are the same work on every engine, and on a small host their time spreads
    by tens of milliseconds from one request to the next: more than the fixed cost. Less the
    forward phase, what remains of a TTFT is what the hooks and vLLM's handling around them
    take, which a no-op connector (cn) measures for vLLM alone."""
    gaps: dict[int, Gap] = {}
    table = report.table(
        "Outside the forward pass, paired against (cn) (ms)",
        ["context", "engine", "TTFT less the forward pass", "minus (cn): median"]
        + ["its 90% interval", "p25", "p75", "pairs"],
    )
    for name in ("cp", "b"):
        for context, runs in samples[name].items():
            pairs = [
                (outside, base)
                for outside, base in zip(
                    map(_outside_ms, runs), map(_outside_ms, samples["cn"][context]), strict=True
                )
                if outside is not None and base is not None
            ]
            if not pairs:
                continue
            gap = Gap.of([outside - base for outside, base in pairs])
            if name == "b":
                gaps[context] = gap
            table.add(
                context,
                f"({name})",
                median([outside for outside, _ in pairs]),
                *_gap_cells(gap),
                len(pairs),
            )
    table.notes += [
        "Each query's TTFT less its forward phase (the phase table's layers), minus the same "
        "for (cn) on the same query; its interval as above. (b)'s copy counts here when it "
        "runs before the layers (loads under the plugin's overlap_load_min_bytes) and not "
        "when it runs beside them: the layers' waits for it fall in the forward phase.",
    ]
    return gaps


def _gap_cells(gap: Gap) -> list[object]:
    """A paired gap's table cells: its median, the median's interval, the quartiles."""
    low_high = f"{gap.low:.2f} to {gap.high:.2f}"
    return [gap.median, low_high, percentile(gap.values, 25), percentile(gap.values, 75)]


def _outside_ms(sample: Sample) -> float | None:
    phases = _phase_times(sample)
    return None if phases is None else sample.ttft_s * 1e3 - phases[FORWARD]


def _caller_copy_ms(sample: Sample) -> float:
    """(b)'s copy when it ran in ``start_load_kv``, before the layers (so in the TTFT less
    the forward pass); 0 when it ran beside them or there was none."""
    span = _copy_span(sample)
    if span is None:
        return 0.0
    located, copied = span
    returned = first_mark(sample.marks, "start_load_kv<", located)
    return copied - located if returned is not None and copied <= returned else 0.0


def _copy_ms(sample: Sample) -> float | None:
    span = _copy_span(sample)
    return None if span is None else span[1] - span[0]


def _copy_span(sample: Sample) -> tuple[float, float] | None:
    """When (b)'s copy started (its chunks located) and ended, or None without a load."""
    located = first_mark(sample.marks, "load.located")
    copied = first_mark(sample.marks, "load.copied", located) if located is not None else None
    return None if located is None or copied is None else (located, copied)


def _mark_timelines(samples: dict[str, dict[int, list[Sample]]]) -> dict[str, Any]:
    """Per engine and context, each mark's median time from the request's start (its first
    occurrence per request), in time order: the finer view behind the phase table."""
    out: dict[str, Any] = {}
    for name, by_context in samples.items():
        for context, runs in by_context.items():
            times: dict[str, list[float]] = {}
            for s in runs:
                seen: set[str] = set()
                for ms, mark in s.marks:
                    if mark not in seen:
                        seen.add(mark)
                        times.setdefault(mark, []).append(ms)
            medians = {mark: round(median(t), 3) for mark, t in times.items()}
            out.setdefault(name, {})[str(context)] = dict(
                sorted(medians.items(), key=lambda kv: kv[1])
            )
    return out


def _phase_times(sample: Sample) -> list[float] | None:
    at = 0.0
    out = []
    for _, first, second in PHASES:
        start = at if not first else first_mark(sample.marks, first, at)
        end = first_mark(sample.marks, second, start) if start is not None else None
        if start is None or end is None:
            return None
        out.append(end - start)
        at = end
    return out

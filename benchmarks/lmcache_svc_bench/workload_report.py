"""``bench workload``'s figures: one ``ConfigResult`` per configuration (the client's saved
result plus deltas of vLLM's and the server's counters), the tables, the plots and the
sanity checks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcache_svc_bench import plots
from lmcache_svc_bench.report import Report
from lmcache_svc_bench.stats import median
from lmcache_svc_bench.workload_serve import Metrics
from lmcache_svc_bench.workload_trace import Conversations, trace_lines

if TYPE_CHECKING:
    from lmcache_svc_bench.workload import Params

LABELS = {
    "plain": "plain vLLM (prefix cache)",
    "arena": "vLLM + lmcache-svc (arena)",
    "ssd": "vLLM + lmcache-svc (arena + SSD)",
}
VLLM_COUNTERS = (
    "prefix_cache_queries", "prefix_cache_hits",
    "external_prefix_cache_queries", "external_prefix_cache_hits",
)  # fmt: skip
TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
SIDECAR_COUNTERS = ("lookup_chunks", "lookup_hit_chunks", "chunk_misses", "index_lookups")
SIDECAR_BY_TIER = ("chunk_hits", "read_bytes", "written_bytes", "evictions", "demotions")


@dataclass
class ConfigResult:
    name: str
    command: str
    client: dict[str, Any]
    vllm: dict[str, float]
    sidecar: dict[str, float] = field(default_factory=dict)

    @classmethod
    def collect(
        cls,
        name: str,
        result_path: Path,
        before: Metrics,
        after: Metrics,
        side_before: Metrics | None,
        side_after: Metrics | None,
        command: str,
    ) -> ConfigResult:
        client = json.loads(result_path.read_text())
        vllm = {key: _delta(after, before, f"vllm:{key}") for key in VLLM_COUNTERS}
        for source in TOKEN_SOURCES:
            vllm[f"prompt_tokens_{source}"] = _delta(
                after, before, "vllm:prompt_tokens_by_source", source=source
            )
        sidecar: dict[str, float] = {}
        if side_before is not None and side_after is not None:
            for key in SIDECAR_COUNTERS:
                sidecar[key] = _delta(side_after, side_before, f"lmcache_svc_{key}")
            for key in SIDECAR_BY_TIER:
                for tier in side_after.label_values(f"lmcache_svc_{key}_total", "tier"):
                    sidecar[f"{key}_{tier}"] = _delta(
                        side_after, side_before, f"lmcache_svc_{key}", tier=tier
                    )
        return cls(name, command, client, vllm, sidecar)

    def rate(self, hits: str, queries: str) -> float | None:
        return self.vllm[hits] / self.vllm[queries] if self.vllm[queries] else None

    def tier_sum(self, key: str) -> float:
        return sum(v for k, v in self.sidecar.items() if k.startswith(key + "_"))


def _delta(after: Metrics, before: Metrics, name: str, **labels: str) -> float:
    """A counter's increase; prometheus_client and vLLM expose counters as ``*_total``."""
    total = name + "_total"
    return after.sum(total, **labels) - before.sum(total, **labels)


def ideal_hit_rate(c: Conversations) -> float:
    """The prefix-cache hit rate of a cache that never evicts: each prompt's longest
    block-aligned prefix already sent, less the one token vLLM always computes."""
    seen: set[tuple[int, ...]] = set()
    num_hit = num_prompt = 0
    for line in trace_lines(c):
        ids: list[int] = line["hash_ids"]  # type: ignore[assignment]
        num_blocks = max((n for n in range(len(ids) + 1) if tuple(ids[:n]) in seen), default=0)
        num_prompt += len(ids) * c.block_tokens
        num_hit += min(num_blocks * c.block_tokens, len(ids) * c.block_tokens - 1)
        seen.update(tuple(ids[:n]) for n in range(1, len(ids) + 1))
    return num_hit / num_prompt


def turn_ttfts(result: ConfigResult, c: Conversations) -> dict[int, list[float]]:
    """The client's per-request TTFTs (ms) grouped by conversation turn."""
    by_turn: dict[int, list[float]] = {}
    for num_tokens, ttft in zip(result.client["input_lens"], result.client["ttfts"]):
        turn = (num_tokens - c.system_tokens) // c.turn_tokens
        by_turn.setdefault(turn, []).append(ttft * 1e3)
    return by_turn


def write_report(
    report: Report,
    p: Params,
    results: Sequence[ConfigResult],
    out_dir: Path,
    *,
    bytes_per_token: int,
) -> None:
    c = p.conversations
    _latency_table(report, results)
    _turn_table(report, results, c)
    _hit_table(report, results, c)
    _bytes_table(report, results)
    _setup_table(report, p, results, bytes_per_token)
    _checks(report, p, results)
    _plots(report, results, c, out_dir)
    report.data["results"] = [asdict(r) for r in results]
    report.data["client_commands"] = {r.name: r.command for r in results}


def _latency_table(report: Report, results: Sequence[ConfigResult]) -> None:
    table = report.table(
        "TTFT and throughput (vllm bench serve's own figures)",
        ["configuration", "completed", "failed", "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms",
         "TTFT mean / plain", "requests/s", "output tokens/s", "total tokens/s", "seconds"],
    )  # fmt: skip
    plain = next((r for r in results if r.name == "plain"), None)
    for r in results:
        cl = r.client
        ratio = cl["mean_ttft_ms"] / plain.client["mean_ttft_ms"] if plain else None
        table.add(
            LABELS[r.name], cl["completed"], cl["failed"], cl["mean_ttft_ms"],
            cl["p50_ttft_ms"], cl["p99_ttft_ms"], "" if ratio is None else ratio,
            cl["request_throughput"], cl["output_throughput"], cl["total_token_throughput"],
            cl["duration"],
        )  # fmt: skip
    table.notes.append(
        "TTFT, throughput and duration as vllm bench serve reports them in its saved result "
        "(--save-result); the TTFT a streaming client sees, queueing in the server included."
    )


def _turn_table(report: Report, results: Sequence[ConfigResult], c: Conversations) -> None:
    table = report.table(
        "TTFT by conversation turn (median ms)",
        ["turn", "prompt tokens", *(LABELS[r.name] for r in results)],
    )
    by_config = [turn_ttfts(r, c) for r in results]
    for turn in range(1, c.num_turns + 1):
        table.add(turn, c.prompt_tokens(turn), *(median(t.get(turn, [0.0])) for t in by_config))
    table.notes.append(
        "Turn 1 is a user's first request (its system prompt may be cached, nothing else); "
        "from turn 2 on, the history was sent before and evicted from vLLM's KV space since."
    )


def _hit_table(report: Report, results: Sequence[ConfigResult], c: Conversations) -> None:
    table = report.table(
        "Hit rates",
        ["configuration", "vLLM prefix-cache hit rate", "external (connector) hit rate",
         "prompt tokens computed", "from vLLM's cache", "from the connector",
         "server lookup hit rate (chunks)"],
    )  # fmt: skip
    for r in results:
        lookups = r.sidecar.get("lookup_chunks", 0.0)
        table.add(
            LABELS[r.name],
            _pct(r.rate("prefix_cache_hits", "prefix_cache_queries")),
            _pct(r.rate("external_prefix_cache_hits", "external_prefix_cache_queries")),
            int(r.vllm["prompt_tokens_local_compute"]),
            int(r.vllm["prompt_tokens_local_cache_hit"]),
            int(r.vllm["prompt_tokens_external_kv_transfer"]),
            _pct(r.sidecar["lookup_hit_chunks"] / lookups) if lookups else "",
        )
    table.notes += [
        f"A prefix cache that never evicted would hit {ideal_hit_rate(c):.1%} of the prompt "
        "tokens of this trace; the gap to vLLM's own rate is what its small KV space evicted.",
        "From vLLM's /metrics (vllm:prefix_cache_*, vllm:external_prefix_cache_*, "
        "vllm:prompt_tokens_by_source) and the server's (lmcache_svc_lookup_*), counted over "
        "the client's run only (warm-up excluded).",
        "The server's lookup counters count every lookup: those the plugin answered from the "
        "shared-memory lookup index without a call (docs/architecture.md) arrive in the "
        "client's reports, every 5 s, so the scrape after the run waits one report interval "
        "(lookups of the warm-up reported after the first scrape may fall in the run's "
        "window). The sanity check that the server served hits counts the bytes its tiers "
        "read (lmcache_svc_read_bytes, the bytes table): loads, not promises.",
    ]


def _bytes_table(report: Report, results: Sequence[ConfigResult]) -> None:
    sidecar = [r for r in results if r.sidecar]
    if not sidecar:
        return
    tiers = sorted(
        {k.split("_")[-1] for r in sidecar for k in r.sidecar if k.startswith("read_bytes_")}
    )
    columns = ["configuration"]
    for tier in tiers:
        columns += [
            f"{tier} written MiB",
            f"{tier} read MiB",
            f"{tier} chunk hits",
            f"{tier} evictions",
        ]
    table = report.table("Bytes moved by the server, per tier", columns)
    for r in sidecar:
        row: list[Any] = [LABELS[r.name]]
        for tier in tiers:
            row += [
                r.sidecar.get(f"written_bytes_{tier}", 0.0) / 2**20,
                r.sidecar.get(f"read_bytes_{tier}", 0.0) / 2**20,
                int(r.sidecar.get(f"chunk_hits_{tier}", 0.0)),
                int(r.sidecar.get(f"evictions_{tier}", 0.0)),
            ]
        table.add(*row)
    table.notes.append(
        "From the server's /metrics (lmcache_svc_*_bytes, _chunk_hits, _evictions by tier)."
    )


def _setup_table(
    report: Report, p: Params, results: Sequence[ConfigResult], bytes_per_token: int
) -> None:
    c = p.conversations
    table = report.table("Workload", ["figure", "value"])
    table.add("users x turns = requests", f"{c.num_users} x {c.num_turns} = {c.num_requests}")
    table.add("shared system prompts", f"{c.num_system_prompts} of {c.system_tokens} tokens")
    table.add("tokens added per turn (answer + next message)", c.turn_tokens)
    table.add(
        "prompt tokens, first / last turn", f"{c.prompt_tokens(1)} / {c.prompt_tokens(c.num_turns)}"
    )
    table.add("generated tokens per request", c.output_tokens)
    table.add("distinct tokens in all conversations", c.distinct_tokens())
    table.add("KV bytes per token (model)", f"{bytes_per_token} ({p.model})")
    table.add("vLLM KV space (tokens)", f"{p.num_blocks * 128} ({p.num_blocks} blocks of 128)")
    table.add("server arena (arena configuration)", f"{p.arena_mib} MiB")
    table.add(
        "server arena + SSD tier (ssd configuration)", f"{p.ssd_arena_mib} MiB + {p.ssd_mib} MiB"
    )
    table.add("client concurrency", p.max_concurrency)
    for r in results:
        table.add(f"client command ({r.name})", f"`{r.command}`")


def _checks(report: Report, p: Params, results: Sequence[ConfigResult]) -> None:
    c = p.conversations
    checks = report.table("Sanity checks", ["check", "configuration", "value", "ok"])
    for r in results:
        checks.add("every request completed", r.name, r.client["completed"],
                   r.client["completed"] == c.num_requests and r.client["failed"] == 0)  # fmt: skip
        vllm_rate = r.rate("prefix_cache_hits", "prefix_cache_queries")
        checks.add("vLLM evicted: its hit rate is below a never-evicting cache's", r.name,
                   _pct(vllm_rate), (vllm_rate or 0.0) < ideal_hit_rate(c))  # fmt: skip
        if r.sidecar:
            read = r.tier_sum("read_bytes")  # loads (lookups may never reach the server)
            served = read > 0 and r.vllm["external_prefix_cache_hits"] > 0
            checks.add("the server served hits (bytes read)", r.name, int(read), served)
    checks.notes.append(
        "Outputs are not compared here (random weights, greedy decoding of random tokens): "
        "this benchmark measures time and hits; the end-to-end tests check that a hit gives "
        "the same tokens."
    )
    report.data["checks_ok"] = all(row[-1] for row in checks.rows)


def _plots(
    report: Report, results: Sequence[ConfigResult], c: Conversations, out_dir: Path
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    bars = plots.grouped_bars(
        out_dir / "workload-ttft.png",
        f"TTFT, {c.num_users} users x {c.num_turns} turns (vllm bench serve)",
        ["mean", "p50", "p99"],
        {
            LABELS[r.name]: [r.client[k] for k in ("mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms")]
            for r in results
        },
        "TTFT (ms)",
    )
    turns = list(range(1, c.num_turns + 1))
    by_turn = plots.lines(
        out_dir / "workload-ttft-by-turn.png",
        "Median TTFT by conversation turn",
        turns,
        {LABELS[r.name]: [median(turn_ttfts(r, c).get(t, [0.0])) for t in turns] for r in results},
        "turn (prompt grows by one turn of history)",
        "TTFT (ms)",
    )
    report.plots += [str(path) for path in (bars, by_turn) if path is not None]


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:.1%}"

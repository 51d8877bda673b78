"""``bench hitcost``'s copy baselines: what copying a hit's loaded bytes costs on this host.

The target weighs (b) - (c) against 1 ms plus the time a copy of the bytes (b) loaded takes,
measured in the same run, two ways:

- warm: a memcpy between two warm buffers (``memcpy_gbps``), the loaded bytes at that speed;
- cold: the same bytes copied the way the plugin's mover copies them on the CPU
  (``mover.py``'s ``_HostCopy``: whole chunks in consecutive slots, one strided numpy copy
  per layer into consecutive blocks, counting up or down) into a destination shaped like
  the engine's KV cache (per layer ``[num_blocks, page_bytes]``, as large as the engine's),
  allocated and zeroed once as vLLM's is, then left idle for the bench's idle time before
  each copy, as an engine is before each query.

The buffers are mappings of their own, as the engine's are: the destination a private one,
as torch allocates vLLM's cache (numpy would advise huge pages for an array this large, and
on this host's ``madvise`` setting get them, which torch does not), the source a shared one,
like the arena's segment.

Each cold copy goes to blocks no earlier copy touched (walking through the cache, as a
fresh engine without a prefix cache takes blocks from its free queue), so its destination
was last written when the cache was zeroed; every other copy counts down. The source, one
buffer of whole chunks like consecutive arena slots, is written once and read by every copy,
as (b) reads the same context's slots for every query.

Both verdicts are reported (``copy_targets``): the warm row as before, the cold row beside
it, and a table puts (b)'s own copy in the engine next to both baselines.
"""

from __future__ import annotations

import mmap
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmcache_svc_bench.report import Report
from lmcache_svc_bench.stats import GAP_LEVEL, Gap, median

_CACHE_SIZE_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """The engine's KV cache as the plugin's mover sees it: per layer ``num_blocks`` pages of
    ``page_bytes``; a chunk is ``blocks_per_chunk`` pages of every layer."""

    num_layers: int
    page_bytes: int
    num_blocks: int
    blocks_per_chunk: int

    @property
    def chunk_bytes(self) -> int:
        return self.num_layers * self.blocks_per_chunk * self.page_bytes

    @property
    def cache_bytes(self) -> int:
        return self.num_layers * self.num_blocks * self.page_bytes


def bench_geometry(
    kv_bytes_per_token: int,
    num_layers: int,
    block_size: int,
    chunk_tokens: int,
    cache_tokens: int,
) -> KVGeometry:
    """The geometry of an engine with ``cache_tokens`` of KV cache (vLLM's "KV cache size")."""
    if chunk_tokens % block_size or kv_bytes_per_token % num_layers:
        raise ValueError(
            f"chunks of {chunk_tokens} tokens are not whole blocks of {block_size}, or "
            f"{kv_bytes_per_token} bytes per token do not split over {num_layers} layers"
        )
    return KVGeometry(
        num_layers=num_layers,
        page_bytes=block_size * kv_bytes_per_token // num_layers,
        num_blocks=cache_tokens // block_size,
        blocks_per_chunk=chunk_tokens // block_size,
    )


def engine_cache_tokens(log_path: Path) -> int | None:
    """The KV cache size vLLM logged at start-up, in tokens; None if it logged none."""
    match = _CACHE_SIZE_LINE.search(log_path.read_text(errors="replace"))
    return int(match.group(1).replace(",", "")) if match else None


class ColdCopy:
    """A destination like the engine's KV cache and a source of ``num_chunks`` whole chunks,
    both written once; ``copy(i)`` copies the chunks into the ``i``-th run of unused blocks."""

    def __init__(self, geometry: KVGeometry, num_chunks: int) -> None:
        g = geometry
        self.geometry = g
        self.num_chunks = num_chunks
        # Block 0 is vLLM's null block; past the last run, copies start over at block 1.
        self.num_runs = (g.num_blocks - 1) // max(1, self.num_blocks_copied)
        if num_chunks < 1 or self.num_runs < 1:
            raise ValueError(f"{num_chunks} chunks do not fit a cache of {g.num_blocks} blocks")
        # vLLM allocates its KV cache with torch.zeros: every page written once.
        layer_bytes = g.num_blocks * g.page_bytes
        self.layers = [
            _mapped(layer_bytes, mmap.MAP_PRIVATE).reshape(g.num_blocks, g.page_bytes)
            for _ in range(g.num_layers)
        ]
        chunks = _mapped(num_chunks * g.chunk_bytes, mmap.MAP_SHARED)
        chunks.fill(1)
        shape = (num_chunks, g.num_layers, g.blocks_per_chunk, g.page_bytes)
        self.chunks = chunks.reshape(shape)  # [chunks, layers, blocks, page]

    @property
    def num_blocks_copied(self) -> int:
        return self.num_chunks * self.geometry.blocks_per_chunk

    @property
    def num_bytes(self) -> int:
        """Bytes one copy moves: the chunks' whole bytes."""
        return self.num_chunks * self.geometry.chunk_bytes

    def block_ids(self, i: int) -> list[int]:
        """The blocks of copy ``i``, in the chunks' order: unused ones, counting down when
        ``i`` is odd."""
        n = self.num_blocks_copied
        low = 1 + (i % self.num_runs) * n
        ids = list(range(low, low + n))
        return ids[::-1] if i % 2 else ids

    def copy(self, i: int) -> None:
        """One strided copy per layer, as ``mover.py``'s ``_HostCopy.into``."""
        n, _, k, page = self.chunks.shape
        ids = self.block_ids(i)
        low = min(ids)
        for layer, kv in enumerate(self.layers):
            blocks = kv[low : low + n * k].reshape(n, k, page)
            if i % 2:
                blocks = blocks[::-1, ::-1]
            blocks[...] = self.chunks[:, layer]


def _mapped(num_bytes: int, flags: int) -> np.ndarray:
    """``num_bytes`` zeroed bytes of an anonymous mapping (private or shared) of their own."""
    out = np.frombuffer(mmap.mmap(-1, num_bytes, flags=flags), dtype=np.uint8)
    out.fill(0)
    return out


def cold_copy_ms(
    geometry: KVGeometry,
    num_chunks: int,
    *,
    idle_s: float,
    repeats: int,
    sleep: Callable[[float], None] = time.sleep,
) -> list[float]:
    """``repeats`` cold copies of ``num_chunks`` chunks, each after ``idle_s`` asleep, in ms."""
    cold = ColdCopy(geometry, num_chunks)
    out = []
    for i in range(repeats):
        sleep(idle_s)
        start = time.perf_counter()
        cold.copy(i)
        out.append((time.perf_counter() - start) * 1e3)
    return out


@dataclass(frozen=True)
class CopyBaselines:
    """One run's copies of the loaded bytes: the warm memcpy speed, and the cold copies (ms,
    per context) into ``geometry``'s cache, each after ``idle_s`` asleep."""

    kv_bytes_per_token: int
    warm_gbps: float
    geometry: KVGeometry
    cold_ms: dict[int, list[float]]
    idle_s: float

    def warm_ms(self, num_tokens: float) -> float:
        return num_tokens * self.kv_bytes_per_token / (self.warm_gbps * 1e9) * 1e3


def copy_table(
    report: Report,
    loaded_tokens: dict[int, float],
    engine_ms: dict[int, float | None],
    baselines: CopyBaselines,
) -> tuple[dict[int, float], dict[int, float]]:
    """(b)'s copy in the engine next to both baselines, per context (a table and
    ``report.data["copy_baselines"]``); returns the warm and the cold baselines (ms)."""
    table = report.table(
        "The loaded KV's copy: in the engine and the same run's baselines (ms)",
        ["context", "loaded MB", "(b)'s copy in the engine", "warm memcpy", "cold copy: median"]
        + ["min", "max"],
    )
    warm: dict[int, float] = {}
    cold: dict[int, float] = {}
    data: dict[str, Any] = {}
    for context, tokens in loaded_tokens.items():
        num_bytes = tokens * baselines.kv_bytes_per_token
        warm[context] = baselines.warm_ms(tokens)
        runs = baselines.cold_ms.get(context, [])
        if runs:
            cold[context] = median(runs)
        engine = engine_ms.get(context)
        table.add(
            context,
            num_bytes / 1e6,
            "-" if engine is None else engine,
            warm[context],
            *((cold[context], min(runs), max(runs)) if runs else ("-",) * 3),
        )
        data[str(context)] = {
            "bytes": num_bytes,
            "engine_copy_ms": engine,
            "warm_memcpy_ms": warm[context],
            "cold_copy_ms": cold.get(context),
            "cold_copy_runs_ms": runs,
        }
    g = baselines.geometry
    report.data["copy_baselines"] = {
        "warm_memcpy_gbps": baselines.warm_gbps,
        "cold_cache_bytes": g.cache_bytes,
        "cold_geometry": {"num_layers": g.num_layers, "page_bytes": g.page_bytes}
        | {"num_blocks": g.num_blocks, "blocks_per_chunk": g.blocks_per_chunk},
        "idle_s": baselines.idle_s,
        "contexts": data,
    }
    table.notes.append(
        "(b)'s copy in the engine: load.located to load.copied, median over the queries. warm "
        "memcpy: the loaded bytes at this run's memcpy speed between two warm buffers "
        f"({baselines.warm_gbps:.1f} GB/s). cold copy: the same bytes copied as the mover "
        f"does (one strided copy per layer) into a {g.cache_bytes / 2**20:.0f} MiB cache "
        f"like (b)'s ({g.num_layers} layers x {g.num_blocks} blocks x {g.page_bytes} B), "
        f"zeroed once, {baselines.idle_s} s idle before each copy, each copy into blocks not "
        "touched since (hitcost_copy.py)."
    )
    return warm, cold


CONTROL_MS = 1.0  # how far (cn) - (c) may be from 0 for the pairs to judge a 1 ms target


def control_fault(controls: dict[int, Gap]) -> str:
    """Why the pairs cannot judge the target ("" when they can): (cn) is (c) with a KV
    connector that does nothing, so the median of (cn) - (c) is the pairs' own error; when
    its interval does not reach within ``CONTROL_MS`` of 0 in some context, the host
    treats the engines differently by more than the target itself (seen on a host where
    memory left idle for a second is slow to touch again: (c) 68 ms slower than (cn))."""
    for context, gap in controls.items():
        if gap.low > CONTROL_MS or gap.high < -CONTROL_MS:
            return (
                f"the control pair (cn) - (c) is {gap.median:.2f} ms at {context} (90% interval "
                f"{gap.low:.2f} to {gap.high:.2f}), not within {CONTROL_MS:.0f} ms of 0"
            )
    return ""


def copy_targets(
    report: Report,
    gaps: dict[int, Gap],
    warm: dict[int, float],
    cold: dict[int, float],
    baselines: CopyBaselines,
    controls: dict[int, Gap] | None = None,
) -> None:
    """(b) - (c) (``gaps``, per context) beyond each baseline, worst context, against 1 ms:
    the warm row, then the cold one; not evaluated when the control pair ``controls``
    ((cn) - (c), per context) says the pairs cannot tell (``control_fault``)."""
    gbps = baselines.warm_gbps
    fault = control_fault(controls or {})
    _worst_target(
        report,
        gaps,
        warm,
        lambda ms: f"memcpy time of the loaded KV ({ms:.2f} ms at {gbps:.1f} GB/s, same run)",
        "the phase table shows where the time goes",
        fault,
    )
    mib = baselines.geometry.cache_bytes / 2**20
    repeats = min((len(r) for r in baselines.cold_ms.values()), default=0)
    _worst_target(
        report,
        gaps,
        cold,
        lambda ms: (
            f"cold copy time of the loaded KV ({ms:.2f} ms: the mover's copies into a "
            f"{mib:.0f} MiB cache idle {baselines.idle_s} s, median of {repeats}, same run)"
        ),
        "more than even a copy into cold blocks: the phase table shows where the time goes",
        fault,
    )


def outside_target(report: Report, gaps: dict[int, Gap], caller_copy_ms: dict[int, float]) -> None:
    """(b) - (cn) outside the forward pass (``gaps``, per context) beyond (b)'s own copy
    where it ran before the layers (``caller_copy_ms``; 0 where it ran beside them, as it is
    not in that measure then), worst context, against 1 ms: the hooks' fixed cost, without
    the layers' spread that the whole TTFTs' pairs carry."""
    _worst_target(
        report,
        gaps,
        caller_copy_ms,
        lambda ms: f"copy that ran before the layers ({ms:.2f} ms, (b)'s own, median)",
        "the phase table shows where the time goes",
        measure="(b) - (cn) outside the forward pass, paired median",
    )


GOAL_MS = 1.0


def _worst_target(
    report: Report,
    gaps: dict[int, Gap],
    copy_ms: dict[int, float],
    baseline: Callable[[float], str],
    why_missed: str,
    not_evaluated: str = "",
    measure: str = "(b) - (c), paired median",
) -> None:
    """``measure`` (per context: ``gaps``) beyond a copy baseline, at the context where it
    is largest, against 1 ms; the name gives the median's interval beyond the baseline, and
    a miss says whether that interval reaches the goal (the pairs' noise larger than the
    miss) or lies above it."""
    excess = {c: gaps[c].median - ms for c, ms in copy_ms.items() if c in gaps}
    if not excess:
        return
    context = max(excess, key=lambda c: excess[c])
    ms = copy_ms[context]
    low, high = gaps[context].low - ms, gaps[context].high - ms
    if low <= GOAL_MS:
        noise = f"within the noise: the median's interval reaches {low:.2f} ms"
    else:
        noise = f"beyond the noise: the median's interval starts at {low:.2f} ms"
    report.target(
        f"{measure}, beyond the {baseline(ms)}, worst context ({context}; "
        f"{GAP_LEVEL:.0%} interval {low:.2f} to {high:.2f}), ms",
        excess[context],
        GOAL_MS,
        lower_is_better=True,
        why_missed=f"{noise}; {why_missed}",
        not_evaluated=not_evaluated,
    )

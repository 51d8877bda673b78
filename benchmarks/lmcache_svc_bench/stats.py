"""Small statistics shared by the benchmarks (nearest-rank percentiles, rates, paired
differences)."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in [0, 100]: always one of the measured values."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def gbps(num_bytes: float, seconds: float) -> float:
    """Decimal gigabytes per second (1 GB = 10^9 bytes), as dd and redis-benchmark count."""
    return num_bytes / seconds / 1e9 if seconds > 0 else float("inf")


def ms(seconds: float) -> float:
    return seconds * 1e3


def median_interval(
    values: Sequence[float], *, level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median (``level``: its coverage): the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` nearest-rank percentiles of the medians of
    ``resamples`` resamples (with replacement, seeded: the same values give the same
    interval). One value gives (value, value)."""
    if not values:
        raise ValueError("interval of no values")
    rng = random.Random(seed)
    n = len(values)
    medians = [statistics.median(rng.choices(values, k=n)) for _ in range(resamples)]
    tail = (1 - level) / 2 * 100
    return percentile(medians, tail), percentile(medians, 100 - tail)


GAP_LEVEL = 0.9  # coverage of the interval given with each paired median


@dataclass(frozen=True)
class Gap:
    """Per-query comparisons of one engine's TTFT to a baseline engine's (paired by query:
    differences in ms, or ratios), their median and that median's percentile-bootstrap
    interval (``GAP_LEVEL``): how far the pairs' noise lets the median move."""

    values: list[float]
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Gap:
        low, high = median_interval(values, level=GAP_LEVEL)
        return cls(values, median(values), low, high)

"""PNG plots for the reports (matplotlib, the ``bench`` extra; skipped when it is absent)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def grouped_bars(
    path: Path,
    title: str,
    groups: Sequence[str],
    series: dict[str, Sequence[float]],
    ylabel: str,
    *,
    log: bool = False,
) -> Path | None:
    """One group of bars per entry of ``groups``, one bar per series in each group."""
    plt = _pyplot()
    if plt is None:
        return None
    width_in = min(14.0, max(6.0, 0.35 * len(groups) * max(1, len(series))))
    fig, ax = plt.subplots(figsize=(width_in, 5.0))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + i * width - 0.4 + width / 2 for g in range(len(groups))]
        ax.bar(xs, values, width, label=label)
    ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def lines(
    path: Path,
    title: str,
    xs: Sequence[float],
    series: dict[str, Sequence[float]],
    xlabel: str,
    ylabel: str,
    *,
    baselines: dict[str, Sequence[float]] | None = None,
    logx: bool = False,
) -> Path | None:
    """Measured series as solid lines with markers, baselines as dashed lines."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for label, values in series.items():
        ax.plot(xs, values, marker="o", label=label)
    for (label, values), style in zip((baselines or {}).items(), ["--", ":", "-."] * 4):
        ax.plot(xs, values, linestyle=style, color="gray", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logx:
        ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

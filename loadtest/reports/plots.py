"""PNG plots of bench results: latency CDFs and curves against the arrival rate.

Lifecycle: each function draws one figure from plain series and writes it to a PNG. It
uses matplotlib's object API (`Figure`, whose default canvas is Agg) rather than pyplot,
so there is no global figure state, no display, and no backend switch at import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure

_WIDE_RANGE = 100.0  # max/min above which a latency axis goes logarithmic


def cdf_plot(
    path: Path,
    series: Mapping[str, Sequence[float]],
    *,
    title: str,
    xlabel: str,
    slo: float | None = None,
) -> Path:
    """Empirical CDFs, one line per series (empty series are left out); `slo` is drawn
    as a vertical line."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    positive: list[float] = []
    for name, values in series.items():
        ordered = sorted(values)
        if not ordered:
            continue
        n = len(ordered)
        ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", label=f"{name} (n={n})")
        positive.extend(v for v in ordered if v > 0)
    if positive and max(positive) / min(positive) > _WIDE_RANGE:
        ax.set_xscale("log")
    if slo is not None:
        ax.axvline(slo, color="grey", linestyle="--", label=f"SLO {slo:g}")
    ax.set(title=title, xlabel=xlabel, ylabel="fraction of samples", ylim=(0, 1.02))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def curve_plot(
    path: Path,
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    target: float | None = None,
    unit_interval: bool = False,
) -> Path:
    """(x, y) curves with markers, one per series; `target` is a horizontal line."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    for name, points in series.items():
        ordered = sorted(points)
        if ordered:
            ax.plot([x for x, _ in ordered], [y for _, y in ordered], marker="o", label=name)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", label=f"target {target:g}")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if unit_interval:
        ax.set_ylim(-0.02, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path

"""Terminal tables of the flow-control benchmarks: the capacity search, per-class and
per-tenant rows, targets with PASS/FAIL, and the leak check.

Lifecycle: a benchmark's `table(report)` (its `BenchSpec.table`) calls these once the
run is over; they read the report only. Times are printed in ms, rates in req/s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from loadtest.flow.cluster import LeakCheck
from loadtest.flow.metrics import ClassStats, Latency, TenantStats
from loadtest.harness.capacity_search import SearchResult
from loadtest.harness.target import TargetResult

CLASS_HEADER = (
    f"  {'class':<10}{'budget s':>9}{'offered':>8}{'served':>7}{'met':>6}{'attain':>7}"
    f"{'refused':>8}  {'by status':<16}{'by reason':<30}{'refusal ms p50/p99/max':>24}"
    f"  {'imm/mid/at/late':<16}{'TTFT ms p50/p90/max':>22}{'past':>6}  errors"
)
TENANT_HEADER = (
    f"  {'tenant':<12}{'offered':>8}{'served':>7}{'met':>6}{'attain':>7}{'refused':>8}"
    f"{'KV block-s':>12}{'TTFT ms p50/p90/max':>22}"
)


def _n(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None or math.isnan(value) else f"{value:{spec}}"


def latency(lat: Latency, quantiles: tuple[str, ...] = ("p50_ms", "p90_ms", "max_ms")) -> str:
    return "/".join(_n(getattr(lat, q)) for q in quantiles)


def _counts(counts: dict[str, int]) -> str:
    return ",".join(f"{k}:{v}" for k, v in sorted(counts.items())) or "-"


def class_row(c: ClassStats) -> str:
    timing = "/".join(str(c.refusal_timing.get(k, 0))
                      for k in ("immediate", "mid_wait", "at_budget", "late"))  # fmt: skip
    return (
        f"  {c.priority:<10}{c.budget_s:>9g}{c.offered:>8}{c.served:>7}{c.met:>6}"
        f"{c.attainment:>7.2f}{c.refused:>8}  {_counts(c.refused_by_status):<16}"
        f"{_counts(c.refused_by_reason):<30}"
        f"{latency(c.refusal_latency, ('p50_ms', 'p99_ms', 'max_ms')):>24}  {timing:<16}"
        f"{latency(c.ttft):>22}{c.served_past_budget:>6}  {_counts(c.errors)}"
    )


def tenant_row(t: TenantStats) -> str:
    return (
        f"  {t.tenant:<12}{t.offered:>8}{t.served:>7}{t.met:>6}{t.attainment:>7.2f}"
        f"{t.refused:>8}{t.kv_block_seconds:>12.1f}{latency(t.ttft):>22}"
    )


def capacity_lines(search: SearchResult) -> list[str]:
    probes = ", ".join(f"{p.rate:.3g} -> {p.attainment:.2f}" for p in search.probes)
    base = search.baseline
    goodput = "-" if base is None else f"{base.goodput_rps:.3f} req/s"
    return [
        f"capacity: {search.capacity_rate:.3f} req/s ({search.qualifier}); goodput there "
        f"{goodput}; probes (rate -> attainment): {probes}"
    ]


def target_lines(targets: Sequence[TargetResult]) -> list[str]:
    width = max((len(t.name) for t in targets), default=0)
    return [
        f"  {'PASS' if t.met else 'FAIL'}  {t.name:<{width}}  {_n(t.measured, '.3f')} "
        f"{t.comparison} {t.threshold:g}  {t.context}".rstrip()
        for t in targets
    ]


def leak_line(check: LeakCheck, when: str = "after the run") -> str:
    if check.clean:
        return f"leaks {when}: none"
    held = [str(leaks) for leaks in check.by_gateway if not leaks.clean]
    return f"leaks {when}: " + "; ".join(held)

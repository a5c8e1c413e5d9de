"""The results of a bench run: the JSON file, the markdown summary, and their shape.

Lifecycle: the bench appends a `PointResult` per run point to a `BenchResults` and
rewrites the file after each point with `result_file.write_result` (a crash keeps what
was measured); at the end it writes the plots and `write_markdown`. JSON schema
`pdserve.bench/1`: the run's `provenance`, then the fields of `BenchResults`; every point
holds its `RunMetrics` (latencies in ms, NaN written as null) and one record per request
sent (times in s from the point's start).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loadtest.harness.bench_config import BenchConfig
from loadtest.harness.cost import ClusterCost
from loadtest.harness.metrics import Dist, RequestRecord, RunMetrics, Slo
from loadtest.harness.traffic import TrafficConfig

SCHEMA = "pdserve.bench/1"


@dataclass
class PointResult:
    label: str
    arrival: str
    offered_rate: float | None  # req/s (poisson or trace), None for a closed loop
    concurrency: int | None  # users (closed loop)
    started_at: str  # ISO 8601, wall clock
    metrics: RunMetrics
    requests: list[RequestRecord]

    @property
    def rate(self) -> float:
        """The x of rate plots: the offered rate, else the achieved one."""
        if self.offered_rate is not None:
            return self.offered_rate
        return self.metrics.request_throughput


@dataclass
class BenchResults:
    created: str
    bench: BenchConfig
    traffic: TrafficConfig
    slo: Slo
    points: list[PointResult] = field(default_factory=list)
    plots: dict[str, str] = field(default_factory=dict)  # name -> file next to the JSON
    cost: ClusterCost | None = None  # with --node-cost-per-hour
    schema: str = SCHEMA


def _ms(d: Dist) -> str:
    if not d.count:
        return "-"
    return f"{d.p50:.0f} / {d.p90:.0f} / {d.p99:.0f}"


POINT_HEADER = (
    "| point | sent | ok | errors | req/s | out tok/s | goodput req/s | attainment "
    "| TTFT ms p50/p90/p99 | ITL ms p50/p90/p99 | TPOT ms p50 | E2E ms p50 | prefix hits |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def point_row(label: str, m: RunMetrics) -> str:
    tpot = f"{m.tpot_ms.p50:.0f}" if m.tpot_ms.count else "-"
    e2e = f"{m.e2e_ms.p50:.0f}" if m.e2e_ms.count else "-"
    return (
        f"| {label} | {m.sent} | {m.ok} | {m.errors} | {m.request_throughput:.3f} "
        f"| {m.output_token_throughput:.1f} | {m.goodput:.3f} | {m.slo_attainment:.2f} "
        f"| {_ms(m.ttft_ms)} | {_ms(m.itl_ms)} | {tpot} | {e2e} | {m.prefix_hit_ratio:.2f} |"
    )


def slo_text(slo: Slo) -> str:
    per_token = f" + {slo.ttft_ms_per_token:g} ms per prompt token" if slo.ttft_ms_per_token else ""
    return (
        f"TTFT <= {slo.ttft_ms:g} ms{per_token}; p{100 * slo.itl_quantile:g} of each "
        f"request's inter-token gaps <= {slo.itl_ms:g} ms"
    )


def detail_lines(label: str, m: RunMetrics) -> list[str]:
    """Errors by code and attainment by request class, for one point."""
    lines = []
    if m.errors_by_code:
        codes = ", ".join(f"{c} {n}" for c, n in sorted(m.errors_by_code.items()))
        lines.append(f"- {label}: errors {codes}")
    kinds = "; ".join(
        f"{k}: {km.ok}/{km.sent} ok, attainment {km.slo_attainment:.2f}, "
        f"TTFT p90 {km.ttft_ms.p90:.0f} ms, ITL p90 {km.itl_ms.p90:.0f} ms"
        for k, km in m.by_kind.items()
        if km.sent
    )
    if kinds:
        lines.append(f"- {label}: {kinds}")
    return lines


def cost_lines(cost: ClusterCost, points: list[PointResult]) -> list[str]:
    """The cluster's price and each point's cost per million output tokens at the SLO."""
    workers = ", ".join(f"{n} {role}" for role, n in sorted(cost.workers.items()))
    lines = [f"Cost: {workers} worker(s) at {cost.per_hour:g} per hour (the gateway not counted)."]
    for p in points:
        each = cost.per_million_tokens(p.metrics.goodput_token_throughput)
        value = f"{each:.4g}" if each is not None else "- (no output token within the SLO)"
        lines.append(f"- {p.label}: {value} per million output tokens at the SLO")
    return lines


def write_markdown(path: Path, results: BenchResults) -> Path:
    t = results.traffic
    lines = [
        f"# pdserve bench: {t.workload} workload against {results.bench.gateway}",
        "",
        f"{results.created}. SLO: {slo_text(results.slo)}. Attainment counts errors as "
        "misses; goodput = requests within the SLO per second.",
        "",
        POINT_HEADER,
        *(point_row(p.label, p.metrics) for p in results.points),
        "",
    ]
    for p in results.points:
        lines.extend(detail_lines(p.label, p.metrics))
    lines.append("")
    if results.cost is not None:
        lines.extend([*cost_lines(results.cost, results.points), ""])
    lines.extend(f"![{name}]({file})" for name, file in results.plots.items())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path

"""The headline benchmark's results: derived ratios, JSON, markdown and plots.

Lifecycle: `bench.run_headline` appends one `SystemResult` per deployment to a
`HeadlineResults` and calls `write_outputs` after each; it derives the per-rate goodput
comparison, the capacity ratio (the highest rate holding the attainment target, of the
first deployment over the reference: colocated, or the second when colocated is not
compared) and the short-prompt-only ratio, the first deployment's capacity ratios over
every other one, then writes `headline.json`
(schema `pdserve.headline/1`, with the run's provenance: `result_file`), `headline.md`
and, at the end, the `headline_*.png` plots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.harness.bench_report import (
    POINT_HEADER,
    PointResult,
    detail_lines,
    point_row,
    slo_text,
)
from loadtest.harness.capacity_search import CapacitySearch, Probe
from loadtest.harness.metrics import Slo, max_rate_at
from loadtest.harness.traffic import TrafficConfig
from loadtest.headline.config import HeadlineConfig
from loadtest.headline.deployment import layout
from loadtest.reports.plots import cdf_plot, curve_plot
from loadtest.reports.provenance import Provenance
from loadtest.reports.result_file import write_result
from services.cluster.config import ClusterConfig

SCHEMA = "pdserve.headline/1"


@dataclass
class SystemResult:
    name: str
    cluster: ClusterConfig
    points: list[PointResult] = field(default_factory=list)
    skipped_rates: list[float] = field(default_factory=list)
    short_only: PointResult | None = None
    capacity_rate: float = 0.0  # highest rate holding the attainment target
    # search: bracketed, at_least or below_min; fixed sweep: interpolated, at_least, below_sweep
    capacity_qualifier: str = ""
    chat_points: list[PointResult] = field(default_factory=list)  # the chat-only search
    chat_capacity_rate: float = 0.0
    chat_capacity_qualifier: str = ""
    wall_s: float = 0.0


@dataclass(frozen=True)
class RateComparison:
    """One rate, the first deployment (named disaggregated in the JSON, as when the
    headline compared two) against the reference (`reference`)."""

    rate: float
    disaggregated_goodput: float | None
    colocated_goodput: float | None
    disaggregated_attainment: float | None
    colocated_attainment: float | None
    goodput_ratio: float | None  # first / reference


@dataclass
class HeadlineResults:
    created: str
    config: HeadlineConfig
    traffic: TrafficConfig
    slo: Slo
    host_cpus: int
    systems: list[SystemResult] = field(default_factory=list)
    comparisons: list[RateComparison] = field(default_factory=list)
    capacity_ratio: float | None = None  # None until both ran, or the reference had none
    target_met: bool | None = None
    short_only_goodput_ratio: float | None = None
    chat_capacity_ratio: float | None = None  # first / reference, chat only
    # The first deployment's capacity over each other one's, by name (long mix, chat).
    capacity_ratios: dict[str, float | None] = field(default_factory=dict)
    chat_capacity_ratios: dict[str, float | None] = field(default_factory=dict)
    plots: dict[str, str] = field(default_factory=dict)
    schema: str = SCHEMA


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def reference(names: Sequence[str]) -> str:
    """What the first deployment's ratios are held against: colocated when it is
    compared (and not the first), else the second."""
    return "colocated" if "colocated" in names[1:] else names[1]


def _by_rate(system: SystemResult | None) -> dict[float, PointResult]:
    return {p.rate: p for p in system.points} if system else {}


def as_probe(point: PointResult) -> Probe:
    """A measured point as the capacity search reads it."""
    m = point.metrics
    offered = len(point.requests)
    return Probe(
        point.rate, 0.0, offered, round(m.slo_attainment * offered), m.slo_attainment,
        m.goodput, 0.0,
    )  # fmt: skip


def _searched(points: list[PointResult], cfg: HeadlineConfig) -> tuple[float, str]:
    """A search's capacity: the highest passing rate below the lowest failing one
    (bracketed, at_least or below_min)."""
    search = CapacitySearch(cfg.search)
    for p in points:
        search.record(as_probe(p))
    found = search.result()
    return found.capacity_rate, found.qualifier.value


def _capacity(system: SystemResult, cfg: HeadlineConfig) -> tuple[float, str]:
    """A searched deployment's capacity is the search's; a fixed sweep's crossing is
    interpolated (interpolated, at_least or below_sweep)."""
    if not cfg.rate_list:
        return _searched(system.points, cfg)
    points = [(p.rate, p.metrics.slo_attainment) for p in system.points]
    return max_rate_at(points, cfg.attainment_target)


def derive(results: HeadlineResults) -> None:
    """Capacities, per-rate comparisons and ratios from the points measured so far."""
    for system in results.systems:
        system.capacity_rate, system.capacity_qualifier = _capacity(system, results.config)
        if system.chat_points:
            chat = _searched(system.chat_points, results.config)
            system.chat_capacity_rate, system.chat_capacity_qualifier = chat
    if len(results.systems) < 2:
        return
    first = results.systems[0]
    named = {s.name: s for s in results.systems}
    ref = named[reference(list(named))]
    _compare_rates(results, first, ref)
    results.capacity_ratio = _ratio(first.capacity_rate, ref.capacity_rate)
    ratio = results.capacity_ratio
    results.target_met = ratio is not None and ratio >= results.config.target_ratio
    if first.chat_points and ref.chat_points:
        results.chat_capacity_ratio = _ratio(first.chat_capacity_rate, ref.chat_capacity_rate)
    if first.short_only and ref.short_only:
        results.short_only_goodput_ratio = _ratio(
            first.short_only.metrics.goodput, ref.short_only.metrics.goodput
        )
    others = results.systems[1:]
    results.capacity_ratios = {o.name: _ratio(first.capacity_rate, o.capacity_rate) for o in others}
    results.chat_capacity_ratios = {
        o.name: _ratio(first.chat_capacity_rate, o.chat_capacity_rate)
        for o in others
        if first.chat_points and o.chat_points
    }


def _compare_rates(results: HeadlineResults, first: SystemResult, ref: SystemResult) -> None:
    d_points, c_points = _by_rate(first), _by_rate(ref)
    results.comparisons = []
    for rate in sorted(set(d_points) | set(c_points)):
        d, c = d_points.get(rate), c_points.get(rate)
        dg = d.metrics.goodput if d else None
        cg = c.metrics.goodput if c else None
        results.comparisons.append(
            RateComparison(
                rate,
                dg,
                cg,
                d.metrics.slo_attainment if d else None,
                c.metrics.slo_attainment if c else None,
                _ratio(dg, cg),
            )
        )


def _fmt(value: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _pair(results: HeadlineResults) -> tuple[str, str]:
    """(first deployment, reference) by name."""
    names = [s.name for s in results.systems]
    return names[0], reference(names)


def _other_ratios(ratios: dict[str, float | None], first: str, ref: str) -> list[str]:
    """The first deployment's ratio over each deployment but the reference."""
    return [
        f"- ratio {first} / {name}: {_fmt(ratio, '.2f', 'x')}"
        for name, ratio in ratios.items()
        if name != ref
    ]


def _capacity_lines(results: HeadlineResults) -> list[str]:
    target = results.config.attainment_target
    lines = [f"Capacity = highest arrival rate keeping >= {target:.0%} SLO attainment:", ""]
    for s in results.systems:
        lines.append(f"- {s.name}: {s.capacity_rate:.3f} req/s ({s.capacity_qualifier})")
    if len(results.systems) < 2:
        return lines
    first, ref = _pair(results)
    if results.capacity_ratio is not None:
        verdict = "met" if results.target_met else "NOT met"
        lines.append(
            f"- ratio {first} / {ref}: **{results.capacity_ratio:.2f}x** "
            f"(target >= {results.config.target_ratio:g}x: {verdict})"
        )
    else:
        lines.append(f"- ratio {first} / {ref}: undefined ({ref} held the target at no rate)")
    return lines + _other_ratios(results.capacity_ratios, first, ref)


def _short_lines(results: HeadlineResults) -> list[str]:
    lines = []
    for s in results.systems:
        if s.short_only:
            m = s.short_only.metrics
            lines.append(
                f"- {s.name}: goodput {m.goodput:.3f} req/s, attainment "
                f"{m.slo_attainment:.2f}, TTFT p50 {m.ttft_ms.p50:.0f} ms, "
                f"ITL p50 {m.itl_ms.p50:.0f} ms"
            )
    ratio = results.short_only_goodput_ratio
    if ratio is not None:
        first, ref = _pair(results)
        winner = first if ratio > 1 else ref if ratio < 1 else "neither"
        lines.append(f"- goodput ratio {first} / {ref}: {ratio:.2f}x ({winner} wins)")
    return lines


def _chat_capacity_lines(results: HeadlineResults) -> list[str]:
    """The chat-only capacities by search, when it ran."""
    if not any(s.chat_points for s in results.systems):
        return []
    lines = ["", "Short prompts only, capacity by search:", ""]
    for s in results.systems:
        rates = ", ".join(f"{p.rate:g} ({p.metrics.slo_attainment:.2f})" for p in s.chat_points)
        lines.append(
            f"- {s.name}: {s.chat_capacity_rate:.3f} req/s ({s.chat_capacity_qualifier}; "
            f"probes, rate (attainment): {rates})"
        )
    if len(results.systems) < 2:
        return lines
    first, ref = _pair(results)
    if results.chat_capacity_ratio is not None:
        lines.append(
            f"- ratio {first} / {ref}: **{results.chat_capacity_ratio:.2f}x** (target >= 1.0x)"
        )
    return lines + _other_ratios(results.chat_capacity_ratios, first, ref)


def _rate_table(results: HeadlineResults) -> list[str]:
    """Goodput and attainment of every deployment at every rate any of them ran."""
    names = [s.name for s in results.systems]
    head = "".join(f" {n} goodput | attainment |" for n in names)
    ratio = "goodput ratio" if len(names) <= 2 else "goodput ratio {} / {}".format(*_pair(results))
    lines = [f"| rate req/s |{head} {ratio} |", "|---|" + "---|---|" * len(names) + "---|"]
    by_rate = [_by_rate(s) for s in results.systems]
    ratios = {c.rate: c.goodput_ratio for c in results.comparisons}
    for rate in sorted({r for points in by_rate for r in points}):
        cells = "".join(
            f" {_fmt(p.metrics.goodput)} | {_fmt(p.metrics.slo_attainment, '.2f')} |"
            if (p := points.get(rate))
            else " - | - |"
            for points in by_rate
        )
        lines.append(f"| {rate:g} |{cells} {_fmt(ratios.get(rate), '.2f', 'x')} |")
    return lines


#: What the report says of the workers' dtype where the run did not set one.
DEFAULT_DTYPE_TEXT = "auto (the workers' default)"


def _title(results: HeadlineResults) -> str:
    cfg = results.config
    return "# Headline: " + " vs ".join(
        f"{n} ({layout(n, cfg.elastic_roles).description})" for n in cfg.system_list
    )


def markdown(results: HeadlineResults) -> str:
    cfg, t = results.config, results.traffic
    roles = (
        f"elastic roles {'on' if cfg.elastic_roles else 'off (static split)'}; "
        if "disaggregated" in cfg.system_list
        else ""
    )
    lines = [
        _title(results),
        "",
        f"{results.created}; {results.host_cpus} CPU cores; one core and one torch thread per "
        f"worker (pinned: {cfg.pin_workers}); compute dtype "
        f"{cfg.dtype.value if cfg.dtype else DEFAULT_DTYPE_TEXT}; {roles}"
        "router placement on embedded Redis; KV over "
        f"{cfg.kv_backend}. Workload: chat ({t.tenants} tenants x {t.prompts_per_tenant} "
        f"system prompts of {t.system_tokens} tokens, Zipf {t.zipf_s}; user {t.user_tokens}, "
        f"output {t.chat_output_tokens}) with {t.long_fraction:.0%} long prompts "
        f"({t.long_prompt_tokens} tokens, output {t.long_output_tokens}); Poisson arrivals; "
        f"up to {cfg.num_requests} requests or {cfg.duration_s:g} s per rate.",
        "",
        f"SLO: {slo_text(results.slo)}.",
        "",
        *_rate_table(results),
    ]
    lines += ["", *_capacity_lines(results), ""]
    lines += [f"Short prompts only (chat at {cfg.short_rate:g} req/s):", "", *_short_lines(results)]
    lines += _chat_capacity_lines(results)
    for s in results.systems:
        skipped = ", ".join(f"{r:g}" for r in s.skipped_rates) or "none"
        lines += [
            "",
            f"## {s.name} ({s.wall_s / 60:.1f} min; skipped rates: {skipped})",
            "",
            POINT_HEADER,
        ]
        chat = s.chat_points or ([s.short_only] if s.short_only else [])
        points = [*s.points, *chat]
        lines += [point_row(p.label, p.metrics) for p in points]
        lines += ["", *(d for p in points for d in detail_lines(p.label, p.metrics))]
    lines += ["", *(f"![{name}]({file})" for name, file in results.plots.items())]
    return "\n".join(lines) + "\n"


def _plots(results: HeadlineResults, out: Path) -> dict[str, str]:
    xlabel = "arrival rate (req/s), long-prompt mix"
    curve_plot(
        out / "headline_goodput.png",
        {s.name: [(p.rate, p.metrics.goodput) for p in s.points] for s in results.systems},
        title="Goodput (requests within the SLO per s)",
        xlabel=xlabel,
        ylabel="req/s",
    )
    curve_plot(
        out / "headline_attainment.png",
        {s.name: [(p.rate, p.metrics.slo_attainment) for p in s.points] for s in results.systems},
        title="SLO attainment",
        xlabel=xlabel,
        ylabel="fraction of requests",
        target=results.config.attainment_target,
        unit_interval=True,
    )
    common = set.intersection(*(set(_by_rate(s)) for s in results.systems))
    rate = max(common) if common else None
    picked = {f"{s.name} @ {rate:g}/s": _by_rate(s)[rate] for s in results.systems} if rate else {}
    ttft = {
        k: [1000 * t for r in p.requests if r.ok and (t := r.ttft_s) is not None]
        for k, p in picked.items()
    }
    itl = {
        k: [1000 * g for r in p.requests if r.ok for g in r.token_gaps_s] for k, p in picked.items()
    }
    cdf_plot(out / "headline_ttft_cdf.png", ttft, title="TTFT (highest rate both ran)", xlabel="ms")
    cdf_plot(
        out / "headline_itl_cdf.png",
        itl,
        title="Inter-token latency (highest rate both ran)",
        xlabel="ms",
        slo=results.slo.itl_ms,
    )
    names = ("headline_goodput", "headline_attainment", "headline_ttft_cdf", "headline_itl_cdf")
    return {name: f"{name}.png" for name in names}


def write_outputs(results: HeadlineResults, provenance: Provenance, *, plots: bool) -> Path:
    """Derive, then write headline.json and headline.md (and the plots); returns the md."""
    out = results.config.out_dir
    derive(results)
    if plots and results.systems:
        results.plots = _plots(results, out)
    write_result(out / "headline.json", results, provenance)
    md = out / "headline.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(markdown(results))
    return md

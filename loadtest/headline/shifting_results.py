"""The shifting-workload benchmark's results: what each deployment's runs measured, and
the medians, ratios and target derived from them.

Lifecycle: `shifting.run_shifting` appends one `ShiftRun` per deployment and point (a
rate scale and a round: the whole phase schedule, once) to that deployment's
`SystemShift`, then calls `derive`, which recomputes from the runs so far:

- per deployment and scale, every phase's medians over the rounds (attainment, goodput,
  TTFT and ITL p50/p90) and the whole schedule's (`ScaleSummary`);
- with two or more scales, each deployment's capacity: the highest rate scale whose
  median whole-schedule attainment holds the target (`metrics.max_rate_at`);
- the first deployment's goodput over each other one's, and over the better of the
  others ("best": the higher goodput of that round), per round of a scale, and their
  medians, for the whole schedule and for each phase (`PairRatio`);
- the judged ratio: the capacity ratio (first / best other) after a sweep of two or
  more scales; else the median over rounds of the whole-schedule goodput ratio against
  the better other deployment; and its target (`target_ratio`, met or not).

Rounds pair up by (scale, round): the deployments of one round ran the same request
sequence back to back, so their ratio is not moved by a drift of the shared host's
speed between rounds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from loadtest.harness.metrics import RequestRecord, RunMetrics, Slo, max_rate_at
from loadtest.harness.target import TargetResult
from loadtest.harness.traffic import TrafficConfig
from loadtest.headline.phases import Phase
from loadtest.headline.shifting_config import ShiftingConfig
from services.cluster.config import ClusterConfig

SCHEMA = "pdserve.shifting/1"
BEST = "best"  # PairRatio.other: the better of the other deployments, round by round


@dataclass
class ShiftRun:
    """One deployment's run of one point: the whole schedule at one rate scale."""

    scale: float
    round: int
    position: int  # its turn in the round (0: first)
    started_at: str  # ISO 8601, wall clock
    whole: RunMetrics
    phases: list[RunMetrics]
    requests: list[RequestRecord]


@dataclass(frozen=True)
class PhaseSummary:
    """One phase (or the whole schedule) of a deployment at one scale: medians over its
    rounds (None where no round measured it)."""

    sent: int  # over all rounds
    attainment: float | None
    goodput: float | None  # requests within the SLO per s
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None


@dataclass(frozen=True)
class ScaleSummary:
    scale: float
    rounds: int
    whole: PhaseSummary
    phases: list[PhaseSummary]


@dataclass
class SystemShift:
    name: str
    cluster: ClusterConfig
    unloaded_step_ms: float | None = None  # median token gap of its warm-up
    runs: list[ShiftRun] = field(default_factory=list)
    scales: list[ScaleSummary] = field(default_factory=list)
    capacity_scale: float | None = None  # a sweep's; None with one scale
    capacity_qualifier: str = ""  # interpolated, at_least or below_sweep
    wall_s: float = 0.0


@dataclass(frozen=True)
class PairRatio:
    """The first deployment's goodput over another's (or over the better other one's,
    `other` = "best") at one scale: medians of the paired rounds' ratios."""

    scale: float
    other: str
    whole: float | None
    phases: list[float | None]
    rounds: list[float | None]  # the whole schedule's ratio in each round


@dataclass
class ShiftingResults:
    created: str
    config: ShiftingConfig
    traffic: TrafficConfig
    phases: list[Phase]
    host_cpus: int
    slo: Slo | None = None  # set once the warm-up has measured the decode step
    systems: list[SystemShift] = field(default_factory=list)
    ratios: list[PairRatio] = field(default_factory=list)
    capacity_ratio: float | None = None  # first / better other capacity (a sweep)
    ratio: float | None = None  # the judged ratio (`ratio_basis`)
    ratio_basis: str = ""
    target_met: bool | None = None
    targets: list[TargetResult] = field(default_factory=list)
    schema: str = SCHEMA


def median(values: Iterable[float | None]) -> float | None:
    """The median of the finite values; None if there is none."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(finite) if finite else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize_rounds(metrics: Sequence[RunMetrics]) -> PhaseSummary:
    """Medians over the rounds that sent something."""
    ran = [m for m in metrics if m.sent]
    return PhaseSummary(
        sum(m.sent for m in ran),
        median(m.slo_attainment for m in ran),
        median(m.goodput for m in ran),
        median(m.ttft_ms.p50 for m in ran),
        median(m.ttft_ms.p90 for m in ran),
        median(m.itl_ms.p50 for m in ran),
        median(m.itl_ms.p90 for m in ran),
    )


def _scale_summary(system: SystemShift, scale: float, phases: int) -> ScaleSummary:
    runs = [r for r in system.runs if r.scale == scale]
    return ScaleSummary(
        scale,
        len(runs),
        summarize_rounds([r.whole for r in runs]),
        [summarize_rounds([r.phases[k] for r in runs]) for k in range(phases)],
    )


def _goodputs(run: ShiftRun) -> list[float]:
    """The run's goodput: the whole schedule's, then each phase's."""
    return [run.whole.goodput, *(m.goodput for m in run.phases)]


def pair_ratio(
    scale: float, other: str, first: Sequence[ShiftRun], others: Sequence[Sequence[ShiftRun]]
) -> PairRatio:
    """`first`'s goodput over the best of `others`' in each round both ran at `scale`
    (one other: over that one), then the medians over those rounds."""
    mine = {r.round: r for r in first if r.scale == scale}
    theirs = [{r.round: r for r in runs if r.scale == scale} for runs in others]
    per_round: list[list[float | None]] = []
    for rnd in sorted(mine):
        if not all(rnd in t for t in theirs):
            continue
        best = [max(values) for values in zip(*(_goodputs(t[rnd]) for t in theirs), strict=True)]
        per_round.append([ratio(m, b) for m, b in zip(_goodputs(mine[rnd]), best, strict=True)])
    columns = list(zip(*per_round, strict=True)) if per_round else []
    whole = [row[0] for row in per_round]
    return PairRatio(scale, other, median(whole), [median(c) for c in columns[1:]], whole)


def _capacity(system: SystemShift, target: float) -> tuple[float, str]:
    points = [(s.scale, s.whole.attainment) for s in system.scales]
    return max_rate_at([(x, a) for x, a in points if a is not None], target)


def derive(results: ShiftingResults) -> None:
    """Summaries, capacities, ratios and the target from the runs so far."""
    cfg = results.config
    scales = cfg.scale_list
    for s in results.systems:
        ran = [x for x in scales if any(r.scale == x for r in s.runs)]
        s.scales = [_scale_summary(s, x, len(results.phases)) for x in ran]
        if len(scales) > 1 and s.scales:
            s.capacity_scale, s.capacity_qualifier = _capacity(s, cfg.attainment_target)
    if len(results.systems) < 2:
        return
    first, others = results.systems[0], results.systems[1:]
    results.ratios = []
    for x in scales:
        results.ratios += [pair_ratio(x, o.name, first.runs, [o.runs]) for o in others]
        results.ratios.append(pair_ratio(x, BEST, first.runs, [o.runs for o in others]))
    _judge(results, first, others)


def _judge(results: ShiftingResults, first: SystemShift, others: list[SystemShift]) -> None:
    """The judged ratio and its target."""
    cfg = results.config
    names = " and ".join(o.name for o in others)
    if len(cfg.scale_list) > 1:
        best = max((o.capacity_scale or 0.0 for o in others), default=0.0)
        results.capacity_ratio = ratio(first.capacity_scale, best)
        results.ratio = results.capacity_ratio
        results.ratio_basis = f"capacity (rate scale): {first.name} / the better of {names}"
    else:
        scale = cfg.scale_list[0]
        best_pair = [p for p in results.ratios if p.other == BEST and p.scale == scale]
        results.ratio = best_pair[0].whole if best_pair else None
        results.ratio_basis = (
            f"goodput over the whole schedule at rate scale {scale:g}: {first.name} / the "
            f"better of {names}, median of paired rounds"
        )
    results.targets = []
    results.target_met = None
    if results.ratio is not None:
        target = TargetResult.check(
            f"shifting workload {first.name} / better of {names}",
            results.ratio, ">=", cfg.target_ratio, context=results.ratio_basis,
        )  # fmt: skip
        results.targets = [target]
        results.target_met = target.met

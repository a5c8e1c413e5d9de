"""The noisy-neighbour benchmark: three equal tenants of one class, one of them sending
five times its share; do the other two still get theirs, through one gateway and
through two?

Lifecycle of `python -m loadtest.flow.fairness_bench`:

1. Start a local cluster (1 prefill + 1 decode worker, Redis placement) with two
   gateway replicas sharing the workers and Redis, and tenants A, B, C in its keys file
   (class standard, weight 1 each). Warm both gateways up; take the leak probe's
   baseline.
2. Each tenant's share: `--share-rate`, or a third of the capacity found by a search
   in which A, B and C send equally (`phase.find_capacity`).
3. The phases (`phase_plan`), each `phase_s` of Poisson traffic with a leak check after
   it and `settle_s` of quiet before the next:
   - `backlogged`: A, B and C each at `backlog_factor` (2) shares, one gateway;
   - `backlogged_2gw`: the same, A on gateway 0 and B, C on gateway 1;
   - `alone`: B and C at one share each, without A (one gateway);
   - `noisy`: A at `noisy_factor` (5) shares, B and C at one (one gateway);
   - `alone_2gw`, `noisy_2gw`: the same two with A on gateway 0, B and C on gateway 1
     (the hard case: neither gateway sees all three tenants; only what they share in
     Redis can keep A to its share).
4. Report each phase per tenant; B's and C's attainment in `noisy` over `alone` (and
   `_2gw` over `_2gw`); Jain's index of served KV-block-seconds per tenant in the
   backlogged phases.

Why B and C together without A as the baseline, rather than each alone: the question
is what A's excess costs them, and `alone` is exactly `noisy` minus A. Each alone would
have the whole cluster to itself, more than its share, and so a baseline no fair
scheduler owes it.

Why this order: the fair-share ledger decays (a half-life of about 30 s) but outlives a
phase. The backlogged phases come first, after a search in which all three sent alike,
so the ledger is even when Jain's index is measured. `alone` then leaves A with the
least history, which favours A at the start of `noisy`: if anything, against B and C.
`alone_2gw` sits between the two noisy phases for the same reason.

Targets (PASS/FAIL; exit status 0 either way): each attainment ratio >= 0.9, each Jain
index >= 0.95, nothing leaked after any phase. JSON in `--out` (default
bench-results/fairness.json) with the run's provenance.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from engine.priority import Priority
from loadtest.flow.cluster import FlowCluster, LeakCheck, Tenant, check_leaks, start_leak_probes
from loadtest.flow.cluster import warm_up as warm_cluster
from loadtest.flow.fairness_config import FairnessBenchConfig
from loadtest.flow.phase import PhaseSummary, find_capacity, run_phase, summarize_phase
from loadtest.flow.report import TENANT_HEADER, capacity_lines, leak_line, target_lines, tenant_row
from loadtest.flow.traffic import FlowStream
from loadtest.harness.bench import load_synth
from loadtest.harness.bench_main import BenchSpec, Progress, run_main
from loadtest.harness.capacity_search import Qualifier, SearchResult
from loadtest.harness.settings import RunSettings
from loadtest.harness.target import TargetResult
from loadtest.reports.sources import SERVING_STACK
from loadtest.workloads.prompt_text import TextSynth

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (*SERVING_STACK, "loadtest/flow", "loadtest/harness", "loadtest/workloads")

SCHEMA = "pdserve.fairness_bench/1"
CLASS = Priority.STANDARD
NOISY, QUIET = "tenant-a", ("tenant-b", "tenant-c")
TENANTS = tuple(Tenant(n, CLASS, CLASS) for n in (NOISY, *QUIET))
GATEWAYS = 2

progress = Progress("fairness_bench")


@dataclass(frozen=True)
class PhasePlan:
    label: str
    streams: list[FlowStream]


def _streams(rates: dict[str, float], split: bool) -> list[FlowStream]:
    """Split: the noisy tenant alone on gateway 0, the quiet ones on gateway 1."""
    return [FlowStream(t, CLASS, r, int(split and t != NOISY)) for t, r in rates.items()]


def phase_plan(share: float, cfg: FairnessBenchConfig) -> list[PhasePlan]:
    backlog = {t.name: cfg.backlog_factor * share for t in TENANTS}
    alone = dict.fromkeys(QUIET, share)
    noisy = {NOISY: cfg.noisy_factor * share, **alone}
    return [
        PhasePlan("backlogged", _streams(backlog, False)),
        PhasePlan("backlogged_2gw", _streams(backlog, True)),
        PhasePlan("alone", _streams(alone, False)),
        PhasePlan("noisy", _streams(noisy, False)),
        PhasePlan("alone_2gw", _streams(alone, True)),
        PhasePlan("noisy_2gw", _streams(noisy, True)),
    ]


@dataclass(frozen=True)
class Isolation:
    """A quiet tenant's attainment beside the noisy one, against without it."""

    tenant: str
    noisy_phase: str
    alone_phase: str
    alone_attainment: float
    noisy_attainment: float
    ratio: float


@dataclass(frozen=True)
class PhaseLeaks:
    phase: str
    check: LeakCheck


@dataclass(frozen=True)
class FairnessReport:
    schema: str
    settings: RunSettings
    config: FairnessBenchConfig
    share_rate: float
    capacity: SearchResult
    phases: list[PhaseSummary]
    isolation: list[Isolation]
    kv_jain: dict[str, float]  # backlogged phase -> Jain's index of KV-block-seconds
    leaks: list[PhaseLeaks]
    targets: list[TargetResult]


def isolation(phases: Sequence[PhaseSummary]) -> list[Isolation]:
    by_label = {p.label: p for p in phases}
    out = []
    for noisy, alone in (("noisy", "alone"), ("noisy_2gw", "alone_2gw")):
        if noisy not in by_label or alone not in by_label:
            continue
        for tenant in QUIET:
            a = next(t.attainment for t in by_label[alone].tenants if t.tenant == tenant)
            n = next(t.attainment for t in by_label[noisy].tenants if t.tenant == tenant)
            out.append(Isolation(tenant, noisy, alone, a, n, n / a if a else float("nan")))
    return out


def targets(
    cfg: FairnessBenchConfig, iso: Sequence[Isolation], jain: dict[str, float],
    leaks: Sequence[PhaseLeaks],
) -> list[TargetResult]:  # fmt: skip
    out = [
        TargetResult.check(f"{i.tenant} attainment {i.noisy_phase} / {i.alone_phase}",
                           i.ratio, ">=", cfg.isolation_target,
                           f"{i.noisy_attainment:.2f} vs {i.alone_attainment:.2f}")
        for i in iso
    ]  # fmt: skip
    out += [TargetResult.check(f"Jain KV-block-s {label}", value, ">=", cfg.jain_target)
            for label, value in jain.items()]  # fmt: skip
    clean = all(p.check.clean for p in leaks)
    out.append(TargetResult.check("leak checks clean (1 = yes)", float(clean), ">=", 1,
                                  f"{len(leaks)} checks"))  # fmt: skip
    return out


async def _share(
    fc: FlowCluster, cfg: FairnessBenchConfig, synth: TextSynth
) -> tuple[float, SearchResult]:
    if cfg.share_rate is not None:
        return cfg.share_rate, SearchResult(3 * cfg.share_rate, Qualifier.GIVEN, None, [])

    def even(rate: float) -> list[FlowStream]:
        return _streams({t.name: rate / len(TENANTS) for t in TENANTS}, False)

    search = await find_capacity(fc, cfg, synth, even, progress)
    if search.capacity_rate <= 0:
        raise RuntimeError(f"no rate down to {cfg.search_min_rate} req/s held attainment "
                           f"{cfg.attainment_target}: no share to give")  # fmt: skip
    return search.capacity_rate / len(TENANTS), search


async def _measure(
    fc: FlowCluster, settings: RunSettings, cfg: FairnessBenchConfig, synth: TextSynth
) -> FairnessReport:
    slo = cfg.slo()
    await warm_cluster(fc, cfg.warmup_requests, cfg.output_tokens)
    probes = await start_leak_probes(fc)
    share, search = await _share(fc, cfg, synth)
    progress(f"share {share:.3f} req/s per tenant (capacity {search.capacity_rate:.3f})")
    weights = {t.name: t.weight for t in TENANTS}
    phases: list[PhaseSummary] = []
    leaks: list[PhaseLeaks] = []
    for plan in phase_plan(share, cfg):
        if phases:
            await asyncio.sleep(cfg.settle_s)
        records = await run_phase(fc, plan.streams, cfg.phase_s, cfg, synth, plan.label)
        summary = summarize_phase(plan.label, plan.streams, cfg.phase_s, records, slo, weights)
        phases.append(summary)
        leaks.append(PhaseLeaks(plan.label, await check_leaks(probes)))
        progress(f"{plan.label}: {summary.offered} sent, attainment {summary.attainment:.2f}, "
                 f"Jain {summary.kv_jain_index:.3f}; {leak_line(leaks[-1].check)}")  # fmt: skip
    iso = isolation(phases)
    jain = {p.label: p.kv_jain_index for p in phases if p.label.startswith("backlogged")}
    return FairnessReport(SCHEMA, settings, cfg, share, search, phases, iso, jain, leaks,
                          targets(cfg, iso, jain, leaks))  # fmt: skip


def run(settings: RunSettings, cfg: FairnessBenchConfig) -> FairnessReport:
    synth = load_synth(settings)
    with FlowCluster(cfg, settings, TENANTS, gateways=GATEWAYS) as fc:
        return asyncio.run(_measure(fc, settings, cfg, synth))


def format_table(r: FairnessReport) -> str:
    searched = capacity_lines(r.capacity) if r.capacity.probes else []
    lines = [*searched, f"share: {r.share_rate:.3f} req/s per tenant"]
    for p in r.phases:
        rates = ", ".join(f"{s.tenant}@{s.rate:g}->gw{s.gateway}" for s in p.streams)
        lines += [
            f"{p.label} ({rates}): attainment {p.attainment:.2f}, goodput "
            f"{p.goodput.requests_per_s:.3f} req/s, Jain KV-block-s {p.kv_jain_index:.3f}",
            TENANT_HEADER,
            *(tenant_row(t) for t in p.tenants),
        ]
    lines += [
        *(leak_line(p.check, f"after {p.phase}") for p in r.leaks if not p.check.clean),
        "targets:",
        *target_lines(r.targets),
    ]
    return "\n".join(lines)


SPEC = BenchSpec(
    name="fairness",
    module="loadtest.flow.fairness_bench",
    description="Noisy neighbour: three equal tenants, one sending 5x its share, through one "
    "gateway and through two; isolation ratios and Jain's index of KV-block-seconds.",
    config=FairnessBenchConfig,
    run=run,
    table=format_table,
    settings=("out", "model", "model_cache_dir"),
    measures=MEASURES,
)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())

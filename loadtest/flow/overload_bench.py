"""The overload benchmark: offer a cluster three times what it can serve and check that
admission control says no fast, in class order, and keeps serving what it admits.

Lifecycle of `python -m loadtest.flow.overload_bench`:

1. Start a local cluster (1 prefill + 1 decode worker, Redis placement, one gateway)
   with one tenant per class in its API keys file (each may ask for any class; each
   request asks for its own class in `GenerateRequest.priority`). Warm it up, and take
   the leak probe's baseline.
2. Find capacity (`phase.find_capacity`): the highest Poisson rate of the class
   mix (default 20% critical, 50% standard, 30% sheddable; ~200-token unique prompts,
   32 output tokens, streamed over gRPC) whose attainment holds 90%; a request meets
   the SLO when it completes with its first token within its class's TTFT budget. The
   passing probe at that rate is the baseline: its goodput is what overload is compared
   with.
3. Offer `overload_factor` (3) x capacity of the same mix for `duration_s`.
4. Report per class: offered, served, attainment, refusals by status (429/503) and
   reason, refusal latency and whether each came at once or at its budget (`FlowSlo`),
   TTFT of the served and how many were served past budget + 10%; goodput under
   overload against goodput at capacity. Then the leak probe: nothing may be held.

Targets (reported PASS/FAIL; the exit status is 0 either way): critical attainment
>= 0.95, goodput ratio >= 0.9, no refusal later than allowed, none served past its
budget + 10%, nothing leaked. The JSON (`--out`, default bench-results/overload.json)
carries the run's provenance.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.priority import Priority
from loadtest.flow.cluster import FlowCluster, LeakCheck, Tenant, check_leaks, start_leak_probes
from loadtest.flow.cluster import warm_up as warm_cluster
from loadtest.flow.overload_config import OverloadBenchConfig
from loadtest.flow.phase import PhaseSummary, find_capacity, run_phase, summarize_phase
from loadtest.flow.report import (
    CLASS_HEADER,
    capacity_lines,
    class_row,
    leak_line,
    target_lines,
)
from loadtest.flow.traffic import FlowStream, class_mix
from loadtest.harness.bench import load_synth
from loadtest.harness.bench_main import BenchSpec, Progress, run_main
from loadtest.harness.capacity_search import SearchResult
from loadtest.harness.settings import RunSettings
from loadtest.harness.target import TargetResult
from loadtest.reports.sources import SERVING_STACK
from loadtest.workloads.prompt_text import TextSynth

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (*SERVING_STACK, "loadtest/flow", "loadtest/harness", "loadtest/workloads")

SCHEMA = "pdserve.overload_bench/1"
TENANTS = {p: Tenant(f"tenant-{p.label}", default_class=p) for p in Priority}

progress = Progress("overload_bench")


@dataclass(frozen=True)
class OverloadReport:
    schema: str
    settings: RunSettings
    config: OverloadBenchConfig
    budgets_s: dict[str, float]
    capacity: SearchResult
    overload_rate: float
    overload: PhaseSummary
    goodput_at_capacity_rps: float
    goodput_ratio: float  # goodput under overload / at capacity (requests)
    late_refusals: int
    served_past_budget: int
    leaks: LeakCheck
    targets: list[TargetResult]


def streams_at(cfg: OverloadBenchConfig) -> Callable[[float], list[FlowStream]]:
    """What a probe (or the run) at `rate` sends: the class mix, one tenant per class."""

    def at(rate: float) -> list[FlowStream]:
        return class_mix(rate, cfg.mix, {p: t.name for p, t in TENANTS.items()})

    return at


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def targets(cfg: OverloadBenchConfig, overload: PhaseSummary, ratio: float,
            leaks: LeakCheck) -> list[TargetResult]:  # fmt: skip
    out = []
    critical = next((c for c in overload.classes if c.priority == Priority.CRITICAL.label), None)
    if critical is not None:
        out.append(TargetResult.check(
            "critical attainment", critical.attainment, ">=", cfg.critical_attainment_target,
            f"{critical.met} of {critical.offered} met"))  # fmt: skip
    late = sum(c.late_refusals for c in overload.classes)
    past = sum(c.served_past_budget for c in overload.classes)
    refused = sum(c.refused for c in overload.classes)
    out += [
        TargetResult.check("goodput ratio (overload / capacity)", ratio, ">=",
                           cfg.goodput_ratio_target),
        TargetResult.check("refusals later than allowed", late, "<=", 0,
                           f"of {refused} refusals"),
        TargetResult.check("served past budget + 10%", past, "<=", 0,
                           f"of {sum(c.served for c in overload.classes)} served"),
        TargetResult.check("leak check clean (1 = yes)", float(leaks.clean), ">=", 1),
    ]  # fmt: skip
    return out


async def _measure(
    fc: FlowCluster, settings: RunSettings, cfg: OverloadBenchConfig, synth: TextSynth
) -> OverloadReport:
    slo = cfg.slo()
    await warm_cluster(fc, cfg.warmup_requests, cfg.output_tokens)
    probes = await start_leak_probes(fc)
    at = streams_at(cfg)
    search = await find_capacity(fc, cfg, synth, at, progress)
    if search.baseline is None or search.capacity_rate <= 0:
        raise RuntimeError(
            f"no rate down to {cfg.search_min_rate} req/s held attainment "
            f"{cfg.attainment_target}: the cluster cannot be overloaded from a capacity of 0"
        )
    rate = cfg.overload_factor * search.capacity_rate
    progress(f"capacity {search.capacity_rate:.3f} req/s ({search.qualifier}); offering "
             f"{rate:.3f} req/s for {cfg.duration_s:g} s")  # fmt: skip
    streams = at(rate)
    records = await run_phase(fc, streams, cfg.duration_s, cfg, synth, "overload")
    weights = {t.name: t.weight for t in TENANTS.values()}
    overload = summarize_phase("overload", streams, cfg.duration_s, records, slo, weights)
    leaks = await check_leaks(probes)
    ratio = _ratio(overload.goodput.requests_per_s, search.baseline.goodput_rps)
    return OverloadReport(
        schema=SCHEMA, settings=settings, config=cfg,
        budgets_s={p.label: slo.budget_s(p) for p in Priority}, capacity=search,
        overload_rate=rate, overload=overload,
        goodput_at_capacity_rps=search.baseline.goodput_rps, goodput_ratio=ratio,
        late_refusals=sum(c.late_refusals for c in overload.classes),
        served_past_budget=sum(c.served_past_budget for c in overload.classes),
        leaks=leaks, targets=targets(cfg, overload, ratio, leaks),
    )  # fmt: skip


def run(settings: RunSettings, cfg: OverloadBenchConfig) -> OverloadReport:
    synth = load_synth(settings)
    with FlowCluster(cfg, settings, list(TENANTS.values())) as fc:
        return asyncio.run(_measure(fc, settings, cfg, synth))


def format_table(r: OverloadReport) -> str:
    o = r.overload
    return "\n".join([
        *capacity_lines(r.capacity),
        f"overload: {r.overload_rate:.3f} req/s offered for {o.duration_s:g} s "
        f"({r.config.overload_factor:g}x capacity), {o.offered} requests, attainment "
        f"{o.attainment:.2f}",
        CLASS_HEADER,
        *(class_row(c) for c in o.classes),
        f"goodput: {o.goodput.requests_per_s:.3f} req/s ({o.goodput.tokens_per_s:.1f} tok/s) "
        f"under overload vs {r.goodput_at_capacity_rps:.3f} req/s at capacity -> "
        f"{r.goodput_ratio:.2f}x",
        leak_line(r.leaks),
        "targets:",
        *target_lines(r.targets),
    ])  # fmt: skip


SPEC = BenchSpec(
    name="overload",
    module="loadtest.flow.overload_bench",
    description="Overload: find capacity, offer 3x it with a class mix, and report refusals, "
    "attainment per class and goodput against capacity.",
    config=OverloadBenchConfig,
    run=run,
    table=format_table,
    settings=("out", "model", "model_cache_dir"),
    measures=MEASURES,
)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())

"""The decode-heavy overload benchmark: long outputs at three times the cluster's
capacity, with the gateway's ITL admission on, against the same run with it off.

Lifecycle of `python -m loadtest.flow.decode_overload_bench`:

1. Start a local cluster (1 prefill + 1 decode worker, one gateway, a tenant per class)
   with ITL admission off (`--itl-budget-s 0`, what the gateway did before it had
   one): the baseline. Warm it up and measure one stream alone: the median gap between
   its tokens is the unloaded decode step. The ITL SLO is `itl_slo_factor` times it
   (unless `--itl-slo-ms` gives one): a request meets the SLO when it completes, its
   first token within its class's TTFT budget and the p90 of its own token gaps within
   the ITL SLO.
2. Find capacity on the baseline (`phase.find_capacity`): the highest Poisson rate of
   the class mix (short prompts, long outputs) holding 90% attainment. Offer
   `overload_factor` x that for `duration_s`: the baseline's overload.
3. Start a second cluster, ITL admission on with `--itl-budget-s` = `itl_budget_share`
   x the SLO (the budget bounds the mean decode step, the SLO a request's p90 gap), and
   run `rounds` paired rounds on it: the capacity rate for `duration_s`, then the same
   overload for as long. Each round's goodput ratio is its overload's goodput over its
   own capacity run's, so drift of the shared host between rounds cancels.
4. Report both overloads per class (ITL p90 of the served beside TTFT and refusals; the
   rounds' overloads pooled), the paired rounds' goodputs and ratios, and whether every
   refusal carried a retry hint; the leak probe after each deployment.

Targets (with ITL admission on; PASS/FAIL, exit status 0 either way): critical ITL p90
within the SLO, the median of the rounds' goodput ratios >= 0.9, every refusal with a
retry hint, nothing leaked. The baseline's ratio is one overload run against the
search's probe at capacity.
The baseline's numbers stand beside them. The JSON (`--out`, default
bench-results/decode_overload.json) carries the run's provenance.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from engine.priority import Priority
from loadtest.flow.cluster import FlowCluster, LeakCheck, check_leaks, start_leak_probes
from loadtest.flow.cluster import warm_up as warm_cluster
from loadtest.flow.metrics import attainment, goodput, share
from loadtest.flow.overload_bench import TENANTS, streams_at
from loadtest.flow.overload_config import OverloadBenchConfig
from loadtest.flow.phase import PhaseSummary, find_capacity, run_phase, summarize_phase
from loadtest.flow.record import FlowRecord
from loadtest.flow.report import CLASS_HEADER, capacity_lines, class_row, leak_line, target_lines
from loadtest.flow.runner import FlowPace, run_flow
from loadtest.flow.traffic import FlowRequest
from loadtest.harness.bench import load_synth
from loadtest.harness.bench_main import BenchSpec, Progress, run_main
from loadtest.harness.capacity_search import SearchResult
from loadtest.harness.request_spec import BenchRequest
from loadtest.harness.settings import RunSettings
from loadtest.harness.target import TargetResult
from loadtest.reports.sources import SERVING_STACK
from loadtest.workloads.prompt_text import TextSynth

#: The source paths these numbers describe (`loadtest.reports.sources`).
MEASURES = (*SERVING_STACK, "loadtest/flow", "loadtest/harness", "loadtest/workloads")
SCHEMA = "pdserve.decode_overload_bench/1"

progress = Progress("decode_overload_bench")


@dataclass(frozen=True)
class DecodeOverloadConfig(OverloadBenchConfig):
    prompt_tokens: int = field(default=64, metadata={"help": "prompt tokens per request"})
    output_tokens: int = field(default=192, metadata={"help": "output tokens per request"})
    duration_s: float = field(
        default=60.0,
        metadata={"help": "seconds of traffic per run: the baseline's overload, and each "
                  "paired round's capacity run and overload"},
    )  # fmt: skip
    rounds: int = field(
        default=3,
        metadata={"help": "paired rounds (capacity, then overload) with ITL admission on"},
    )
    request_timeout_s: float = field(
        default=120.0, metadata={"help": "client deadline of one stream"}
    )
    itl_slo_factor: float = field(
        default=3.0,
        metadata={"help": "the ITL SLO, in multiples of one stream's unloaded decode step"},
    )
    itl_budget_share: float = field(
        default=0.8,
        metadata={"help": "the gateway's --itl-budget-s with admission on, as a share of the SLO"},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.itl_slo_factor <= 1 or not 0 < self.itl_budget_share <= 1:
            raise ValueError("itl_slo_factor must be > 1 and itl_budget_share in (0, 1]")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")


@dataclass(frozen=True)
class PairedRound:
    """One round with ITL admission on: goodput at the capacity rate, then overloaded.

    Goodput at capacity is the rate times the share of its requests that met the SLO,
    not met requests over the window: how many arrive in a Poisson window varies by
    about 1/sqrt(n) (9% for 120), which would swing the ratio by as much while the
    overload's goodput, bound by service, hardly moves with its arrivals."""

    capacity_rate: float
    capacity_attainment: float
    capacity_goodput_rps: float
    overload_goodput_rps: float

    @classmethod
    def of(cls, capacity_rate: float, attainment: float, overload_rps: float) -> PairedRound:
        return cls(capacity_rate, attainment, capacity_rate * attainment, overload_rps)

    @property
    def ratio(self) -> float:
        return share(self.overload_goodput_rps, self.capacity_goodput_rps)


@dataclass(frozen=True)
class Deployment:
    """One cluster's overload: its ITL budget (0: admission on TTFT alone) and results.
    `goodput_ratio`: overload / capacity, the median over `rounds` when it has any
    (ITL admission on), else against the baseline's search probe at capacity."""

    itl_budget_s: float
    overload: PhaseSummary  # every overload run's requests pooled
    refusals_without_hint: int
    leaks: LeakCheck
    goodput_ratio: float
    rounds: list[PairedRound] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class DecodeOverloadReport:
    schema: str
    settings: RunSettings
    config: DecodeOverloadConfig
    budgets_s: dict[str, float]
    unloaded_step_ms: float
    itl_slo_ms: float
    capacity: SearchResult
    overload_rate: float
    goodput_at_capacity_rps: float
    baseline: Deployment  # ITL admission off
    itl_admission: Deployment  # on
    critical_itl_p90_ms: float  # with it on
    critical_itl_p90_ms_baseline: float
    targets: list[TargetResult] = dataclasses.field(default_factory=list)


async def unloaded_step_s(fc: FlowCluster, cfg: DecodeOverloadConfig, synth: TextSynth) -> float:
    """The median gap between the tokens of one stream alone on the cluster."""
    tenant = TENANTS[Priority.CRITICAL].name
    spec = BenchRequest(
        request_id="unloaded", kind=Priority.CRITICAL.label, max_tokens=cfg.output_tokens,
        prompt=synth.text(random.Random("unloaded"), cfg.prompt_tokens), tenant=tenant,
    )  # fmt: skip
    request = FlowRequest(spec, tenant, Priority.CRITICAL, 0.0)
    pace = FlowPace(duration_s=1.0, request_timeout_s=cfg.request_timeout_s)
    (record,) = await run_flow(fc.addresses, fc.keys, [request], pace)
    if not record.completed or not record.token_gaps_s:
        raise RuntimeError(f"the unloaded stream failed: {record.code} {record.details}")
    return statistics.median(record.token_gaps_s)


def refusals_without_hint(records: Sequence[FlowRecord]) -> int:
    return sum(1 for r in records if r.refusal is not None and not r.refusal.retry_after_s)


def _summary(
    cfg: DecodeOverloadConfig, label: str, rate: float, runs: int, records: list[FlowRecord]
) -> PhaseSummary:
    weights = {t.name: t.weight for t in TENANTS.values()}
    streams = streams_at(cfg)(rate)
    return summarize_phase(label, streams, runs * cfg.duration_s, records, cfg.slo(), weights)


async def overload(
    fc: FlowCluster, cfg: DecodeOverloadConfig, synth: TextSynth, rate: float,
    goodput_at_capacity: float,
) -> Deployment:  # fmt: skip
    """The baseline: one overload run, against the search's goodput at capacity."""
    probes = await start_leak_probes(fc)
    records = await run_phase(fc, streams_at(cfg)(rate), cfg.duration_s, cfg, synth, "baseline")
    summary = _summary(cfg, "baseline", rate, 1, records)
    leaks = await check_leaks(probes)
    ratio = share(summary.goodput.requests_per_s, goodput_at_capacity)
    return Deployment(cfg.itl_budget_s or 0.0, summary, refusals_without_hint(records), leaks,
                      ratio)  # fmt: skip


async def paired_rounds(
    fc: FlowCluster, cfg: DecodeOverloadConfig, synth: TextSynth, capacity_rate: float,
    rate: float,
) -> Deployment:  # fmt: skip
    """`cfg.rounds` rounds of the capacity rate then the overload, on one cluster."""
    probes = await start_leak_probes(fc)
    slo, pooled, rounds = cfg.slo(), [], []
    for i in range(cfg.rounds):
        at_capacity = await run_phase(fc, streams_at(cfg)(capacity_rate), cfg.duration_s, cfg,
                                      synth, f"capacity{i}")  # fmt: skip
        overloaded = await run_phase(fc, streams_at(cfg)(rate), cfg.duration_s, cfg, synth,
                                     f"itl_admission{i}")  # fmt: skip
        pair = PairedRound.of(capacity_rate, attainment(at_capacity, slo),
                           goodput(overloaded, slo, cfg.duration_s).requests_per_s)  # fmt: skip
        progress(
            f"round {i + 1} of {cfg.rounds}: goodput {pair.capacity_goodput_rps:.3f} req/s "
            f"at capacity, {pair.overload_goodput_rps:.3f} overloaded: {pair.ratio:.2f}x"
        )
        rounds.append(pair)
        pooled += overloaded
    leaks = await check_leaks(probes)
    summary = _summary(cfg, "itl_admission", rate, cfg.rounds, pooled)
    ratio = statistics.median(r.ratio for r in rounds)
    return Deployment(cfg.itl_budget_s or 0.0, summary, refusals_without_hint(pooled), leaks,
                      ratio, rounds)  # fmt: skip


def critical_itl_p90_ms(d: Deployment) -> float:
    critical = [c for c in d.overload.classes if c.priority == Priority.CRITICAL.label]
    return critical[0].itl.p90_ms if critical else float("nan")


def targets(cfg: DecodeOverloadConfig, on: Deployment, slo_ms: float) -> list[TargetResult]:
    refused = sum(c.refused for c in on.overload.classes)
    return [
        TargetResult.check("critical ITL p90 (ms) with ITL admission", critical_itl_p90_ms(on),
                           "<=", slo_ms, "the ITL SLO"),
        TargetResult.check("goodput ratio (overload / capacity)", on.goodput_ratio, ">=",
                           cfg.goodput_ratio_target, _rounds_context(on.rounds)),
        TargetResult.check("refusals without a retry hint", on.refusals_without_hint, "<=", 0,
                           f"of {refused} refusals"),
        TargetResult.check("leak check clean (1 = yes)", float(on.leaks.clean), ">=", 1),
    ]  # fmt: skip


def _rounds_context(rounds: Sequence[PairedRound]) -> str:
    if not rounds:
        return ""
    ratios = [r.ratio for r in rounds]
    return (f"median of {len(rounds)} paired rounds; rounds from {min(ratios):.2f}x "
            f"to {max(ratios):.2f}x")  # fmt: skip


def run(settings: RunSettings, cfg: DecodeOverloadConfig) -> DecodeOverloadReport:
    synth = load_synth(settings)
    off = replace(cfg, itl_budget_s=0.0)
    with FlowCluster(off, settings, list(TENANTS.values())) as fc:
        step_s, slo_cfg, search, rate, baseline = asyncio.run(_baseline(fc, off, synth))
    budget_s = cfg.itl_budget_share * (slo_cfg.itl_slo_ms or 0.0) / 1000
    on_cfg = replace(slo_cfg, itl_budget_s=budget_s)
    progress(f"ITL admission on: --itl-budget-s {budget_s:.4f}")
    goodput_at_capacity = search.baseline.goodput_rps if search.baseline else 0.0
    with FlowCluster(on_cfg, settings, list(TENANTS.values())) as fc:

        async def measure() -> Deployment:
            await warm_cluster(fc, on_cfg.warmup_requests, 16)
            return await paired_rounds(fc, on_cfg, synth, search.capacity_rate, rate)

        on = asyncio.run(measure())
    slo_ms = slo_cfg.itl_slo_ms or 0.0
    return DecodeOverloadReport(
        schema=SCHEMA, settings=settings, config=on_cfg,
        budgets_s={p.label: on_cfg.slo().budget_s(p) for p in Priority},
        unloaded_step_ms=step_s * 1000, itl_slo_ms=slo_ms, capacity=search,
        overload_rate=rate, goodput_at_capacity_rps=goodput_at_capacity,
        baseline=baseline, itl_admission=on,
        critical_itl_p90_ms=critical_itl_p90_ms(on),
        critical_itl_p90_ms_baseline=critical_itl_p90_ms(baseline),
        targets=targets(on_cfg, on, slo_ms),
    )  # fmt: skip


async def _baseline(
    fc: FlowCluster, cfg: DecodeOverloadConfig, synth: TextSynth
) -> tuple[float, DecodeOverloadConfig, SearchResult, float, Deployment]:
    """Warm up, measure the unloaded step (the SLO unless given), find capacity and run
    the overload with ITL admission off."""
    await warm_cluster(fc, cfg.warmup_requests, 16)
    step_s = await unloaded_step_s(fc, cfg, synth)
    slo_ms = cfg.itl_slo_ms or round(cfg.itl_slo_factor * step_s * 1000, 1)
    cfg = replace(cfg, itl_slo_ms=slo_ms)
    progress(f"unloaded decode step {step_s * 1000:.1f} ms: ITL SLO {slo_ms:g} ms")
    search = await find_capacity(fc, cfg, synth, streams_at(cfg), progress)
    if search.baseline is None or search.capacity_rate <= 0:
        raise RuntimeError("no rate held the attainment target: capacity 0, nothing to overload")
    rate = cfg.overload_factor * search.capacity_rate
    progress(f"capacity {search.capacity_rate:.3f} req/s; offering {rate:.3f} req/s to each")
    base = await overload(fc, cfg, synth, rate, search.baseline.goodput_rps)
    return step_s, cfg, search, rate, base


def _deployment_lines(name: str, d: Deployment) -> list[str]:
    o = d.overload
    rounds = [f"  round {i + 1}: goodput {r.capacity_goodput_rps:.3f} req/s at capacity, "
              f"{r.overload_goodput_rps:.3f} overloaded: {r.ratio:.2f}x"
              for i, r in enumerate(d.rounds)]  # fmt: skip
    return [
        f"{name} (--itl-budget-s {d.itl_budget_s:g}): {o.offered} requests, attainment "
        f"{o.attainment:.2f}, goodput {o.goodput.requests_per_s:.3f} req/s "
        f"({d.goodput_ratio:.2f}x capacity's), refusals without a hint {d.refusals_without_hint}",
        *rounds,
        CLASS_HEADER,
        *(class_row(c) + f"  ITL p90 {c.itl.p90_ms:.0f} ms" for c in o.classes),
        leak_line(d.leaks),
    ]


def format_table(r: DecodeOverloadReport) -> str:
    return "\n".join([
        f"unloaded decode step {r.unloaded_step_ms:.1f} ms; ITL SLO {r.itl_slo_ms:g} ms "
        "(p90 of a request's own gaps)",
        *capacity_lines(r.capacity),
        f"overload: {r.overload_rate:.3f} req/s for {r.config.duration_s:g} s, once with ITL "
        f"admission off and in each of {r.config.rounds} paired rounds with it on",
        *_deployment_lines("baseline, ITL admission off", r.baseline),
        *_deployment_lines("ITL admission on", r.itl_admission),
        f"critical ITL p90: {r.critical_itl_p90_ms:.0f} ms with ITL admission, "
        f"{r.critical_itl_p90_ms_baseline:.0f} ms without",
        "targets:",
        *target_lines(r.targets),
    ])  # fmt: skip


SPEC = BenchSpec(
    name="decode_overload",
    module="loadtest.flow.decode_overload_bench",
    description="Decode-heavy overload: long outputs at 3x capacity with ITL admission on, "
    "against the same run with it off.",
    config=DecodeOverloadConfig,
    run=run,
    table=format_table,
    settings=("out", "model", "model_cache_dir"),
    measures=MEASURES,
)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())

"""The shifting-workload benchmark: elastic P/D roles against the static 1P+1D split and
2 mixed workers, on a workload whose mix shifts: chat, then long-prompt-heavy, then chat,
each phase long enough for the workers' roles to move.

Lifecycle: `run_shifting(cfg, traffic, settings)` collects the run's provenance, loads
the tokenizer, starts every deployment (`deployment`: by default `elastic`, `static`,
`colocated`; one core and one torch thread per worker) as a `LocalCluster`, and sends
each a few chat requests one at a time (unmeasured; their token gaps are the unloaded
decode step the ITL SLO is derived from, `shifting_config`). Then, per rate scale and
round, it draws one request sequence over the whole phase schedule (`phases`: Poisson
arrivals at each phase's rate times the scale, stamped with their times) and runs it on
every deployment in turn, one carrying load at a time, the order reversing every round;
each run's records are summarized whole and per phase (a request belongs to the phase
it was sent in). `shifting_report` derives the medians over rounds, the ratios of the
first deployment over each other one and over the better of them, and the target, and
rewrites shifting.json and shifting.md after every run, so an interrupted run keeps what
it measured. The clusters stop however the run ends.

Full run: `python -m loadtest.headline.shifting` (three phases of 120 s, two rounds: about
45 minutes on the 2-core host, each run taking the schedule's 6 minutes plus its drain).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from dataclasses import dataclass, replace
from pathlib import Path

from loadtest.harness.bench import load_synth, now_iso, warm_up
from loadtest.harness.bench_main import Progress, add_settings_args, settings_from_args
from loadtest.harness.metrics import Slo, summarize
from loadtest.harness.runner import Pace
from loadtest.harness.settings import RunSettings
from loadtest.harness.traffic import TrafficConfig
from loadtest.headline.deployment import Deployment, cluster_config, clusters_up, turns
from loadtest.headline.phases import MAX_PHASES, schedule_requests, split_by_phase
from loadtest.headline.shifting_config import ShiftingConfig, unloaded_step_ms
from loadtest.headline.shifting_report import write_outputs
from loadtest.headline.shifting_results import ShiftingResults, ShiftRun, SystemShift
from loadtest.reports.provenance import Provenance, collect_provenance
from loadtest.reports.sources import SERVING_STACK
from loadtest.workloads.prompt_text import TextSynth
from services.common.config import add_config_args, config_from_args

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (*SERVING_STACK, "loadtest/headline", "loadtest/harness", "loadtest/workloads")

SHIFT_STREAM = 20_000  # request stream of the first point's first phase
#: TrafficConfig fields the phases set or this benchmark does not use.
TRAFFIC_EXCLUDED = (
    "workload", "long_fraction", "trace_path", "trace_time_scale", "synthetic_prompt_tokens",
    "synthetic_output_tokens", "synthetic_dist",
)  # fmt: skip

_Deployment = Deployment[SystemShift]


@dataclass(frozen=True)
class _Bench:
    """What every point of one run shares."""

    cfg: ShiftingConfig
    traffic: TrafficConfig
    synth: TextSynth
    results: ShiftingResults
    provenance: Provenance
    progress: Progress


async def _derive_slo(deployments: list[_Deployment], bench: _Bench) -> Slo:
    """Warm every deployment up with chat requests one at a time; their token gaps give
    each one's unloaded decode step, and all of them pooled the SLO's."""
    chat = replace(bench.traffic, workload="chat")
    pooled = []
    for d in deployments:
        records = await warm_up(d.address, bench.cfg, chat, bench.synth)
        d.result.unloaded_step_ms = unloaded_step_ms(records)
        pooled += records
    step = unloaded_step_ms(pooled)
    if bench.cfg.derives_itl_slo and step is None:
        raise RuntimeError("the warm-up streamed no two tokens: no decode step to derive from")
    return bench.cfg.slo(step)


async def _point(deployments: list[_Deployment], i: int, scale: float, bench: _Bench) -> None:
    """One round at one scale: the same request sequence on every deployment in turn."""
    cfg, results = bench.cfg, bench.results
    assert results.slo is not None
    phases, rnd = results.phases, i % cfg.rounds
    scheduled = schedule_requests(phases, scale, bench.traffic, bench.synth,
                                  SHIFT_STREAM + MAX_PHASES * i)  # fmt: skip
    nominal = scale * sum(p.rate * p.duration_s for p in phases) / phases[-1].end_s
    for position, d in enumerate(turns(deployments, i)):
        name = d.result.name
        pace = Pace("poisson", rate=nominal, duration_s=phases[-1].end_s,
                    request_timeout_s=cfg.request_timeout_s, progress=cfg.progress,
                    label=f"{name} x{scale:g} round {rnd + 1}")  # fmt: skip
        bench.progress(
            f"{name}: scale {scale:g}, round {rnd + 1}/{cfg.rounds}, "
            f"{len(scheduled.requests)} requests over {phases[-1].end_s:g} s"
        )
        started = now_iso()
        records = await d.run(scheduled.requests, pace)
        per_phase = split_by_phase(records, scheduled.phase_of, len(phases))
        run = ShiftRun(scale, rnd, position, started, summarize(records, results.slo),
                       [summarize(p, results.slo) for p in per_phase], records)  # fmt: skip
        d.result.runs.append(run)
        write_outputs(results, bench.provenance)
        shares = " / ".join(f"{m.slo_attainment:.2f}" if m.sent else "-" for m in run.phases)
        whole = run.whole
        bench.progress(
            f"{name}: attainment per phase {shares}, whole {whole.slo_attainment:.2f}, "
            f"goodput {whole.goodput:.3f} req/s"
        )


async def _run(deployments: list[_Deployment], bench: _Bench) -> None:
    bench.results.slo = await _derive_slo(deployments, bench)
    bench.progress(f"SLO: ITL {bench.results.slo.itl_ms:.0f} ms; TTFT "
                   f"{bench.results.slo.ttft_ms:g} ms + {bench.results.slo.ttft_ms_per_token:g}"
                   " ms per prompt token")  # fmt: skip
    points = [scale for scale in bench.cfg.scale_list for _ in range(bench.cfg.rounds)]
    for i, scale in enumerate(points):
        await _point(deployments, i, scale, bench)


def run_shifting(cfg: ShiftingConfig, traffic: TrafficConfig, model: RunSettings) -> Path:
    """Every deployment up at once, the points in turn, then the report; returns the
    markdown's path."""
    provenance = collect_provenance(measures=MEASURES)
    synth = load_synth(model)
    mix = replace(traffic, workload="long_mix")
    results = ShiftingResults(now_iso(), cfg, mix, cfg.phase_list, len(os.sched_getaffinity(0)))
    results.systems = [SystemShift(n, cluster_config(n, cfg, model)) for n in cfg.system_list]
    bench = _Bench(cfg, mix, synth, results, provenance, Progress("shifting"))
    with clusters_up([(s.name, s.cluster) for s in results.systems], "shifting") as addresses:
        deployments = [_Deployment(s, a) for s, a in zip(results.systems, addresses, strict=True)]
        asyncio.run(_run(deployments, bench))
    return write_outputs(results, provenance)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.headline.shifting",
        description=__doc__.splitlines()[0] if __doc__ else "",
    )
    add_config_args(parser, ShiftingConfig)
    add_config_args(parser, TrafficConfig, exclude=TRAFFIC_EXCLUDED)
    add_settings_args(parser, ("model", "model_cache_dir"))
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(ShiftingConfig, args)
        traffic = config_from_args(TrafficConfig, args)
        settings = settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    print(run_shifting(cfg, traffic, settings).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

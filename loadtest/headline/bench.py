"""The headline benchmark: disaggregated (1 prefill + 1 decode worker) against colocated
(2 mixed workers), one CPU core per worker, same router, model and workload; the
disaggregated gateway decides per request whether a prompt takes the prefill hop
(conditional disaggregation, `--local-prefill-max-tokens`). `--systems` runs other
deployments, or more of them, in the same way (`deployment`: `--systems
elastic,static,colocated` sets elastic roles against the static split and 2 mixed
workers); the first is the one the ratios are of.

Lifecycle: `run_headline(cfg, traffic, settings)` collects the run's provenance (commit,
time, host: it goes into headline.json), loads the tokenizer, starts every
deployment as a `LocalCluster` (embedded Redis, router placement, workers pinned to a
core each with one torch thread), sends each a few unmeasured requests, then finds each
one's capacity on the long-prompt interference mix by search (`capacity_search`: raise
the rate until attainment falls under the target, then bisect; so no capacity is a
lower bound on whatever host it runs), the deployments taking turns at every round
(Poisson; identical request sequences for all; the order reverses every round).
`--rates` instead sweeps fixed rates, a deployment skipping those above one whose
attainment fell under `stop_below_attainment`. Then the same on short prompts only
(chat), and the clusters stop. Only one deployment carries load at a time. `report` then
derives each deployment's capacity (the highest rate holding the attainment target),
the ratios, the markdown and the plots. Results are rewritten after every rate, so an
interrupted run keeps what it measured.

Full run: `python -m loadtest.headline.bench` (about 40 minutes on the 2-core host, two
deployments; a third adds half again); `make bench` runs a short sweep. The shifting
workload (phases of chat and long prompts) is `shifting`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from loadtest.harness.bench import load_synth, now_iso, warm_up
from loadtest.harness.bench_main import add_settings_args, settings_from_args
from loadtest.harness.bench_report import PointResult
from loadtest.harness.capacity_search import CapacitySearch, SearchConfig
from loadtest.harness.runner import Pace
from loadtest.harness.settings import RunSettings
from loadtest.harness.traffic import TrafficConfig, make_requests
from loadtest.headline.config import HeadlineConfig
from loadtest.headline.deployment import Deployment, cluster_config, clusters_up, turns
from loadtest.headline.report import HeadlineResults, SystemResult, as_probe, write_outputs
from loadtest.reports.provenance import Provenance, collect_provenance
from loadtest.reports.sources import SERVING_STACK
from loadtest.workloads.prompt_text import TextSynth
from services.common.config import add_config_args, config_from_args

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (*SERVING_STACK, "loadtest/headline", "loadtest/harness", "loadtest/workloads")

SYSTEMS = ("disaggregated", "colocated")  # the default deployments (`--systems`)
SHORT_STREAM = 10_000  # request stream of the short-only point (apart from the sweep's)

_Deployment = Deployment[SystemResult]


def _pace(name: str, rate: float, seed: int, duration_s: float, cfg: HeadlineConfig) -> Pace:
    return Pace(
        "poisson",
        rate=rate,
        duration_s=duration_s,
        request_timeout_s=cfg.request_timeout_s,
        seed=seed,
        progress=cfg.progress,
        label=f"{name} {rate:g}/s",
    )


async def _interleaved(
    deployments: list[_Deployment],
    cfg: HeadlineConfig,
    mix: TrafficConfig,
    synth: TextSynth,
    results: HeadlineResults,
    provenance: Provenance,
) -> None:
    for d in deployments:
        await warm_up(d.address, cfg, mix, synth)
    if cfg.rate_list:
        await _sweep(deployments, cfg, mix, synth, results, provenance)
    else:
        mixed = _Probes(mix, cfg.num_requests, cfg.duration_s, cfg.search, "", 1)
        await _search(deployments, cfg, mixed, synth, lambda r: r.points, (results, provenance))
    chat = replace(mix, workload="chat")
    if cfg.chat_search:
        search = replace(cfg.search, start_rate=cfg.short_rate)
        probes = _Probes(chat, cfg.short_num_requests, cfg.short_duration_s, search, "chat ",
                         SHORT_STREAM)  # fmt: skip
        await _search(deployments, cfg, probes, synth, lambda r: r.chat_points,
                      (results, provenance))  # fmt: skip
        for d in deployments:  # the search's first probe is the chat point at short_rate
            d.result.short_only = d.result.chat_points[0]
        return
    requests = make_requests(chat, synth, cfg.short_num_requests, stream=SHORT_STREAM)
    for d in turns(deployments, len(results.systems[0].points)):
        pace = _pace(d.result.name, cfg.short_rate, SHORT_STREAM, cfg.short_duration_s, cfg)
        d.result.short_only = await d.measure(f"chat {cfg.short_rate:g}", requests, pace, cfg.slo)


@dataclass(frozen=True)
class _Probes:
    """What one capacity search sends: its traffic, a probe's size, where it starts."""

    traffic: TrafficConfig
    num_requests: int
    duration_s: float
    search: SearchConfig
    label: str  # before each probe's rate in the report ("chat 1.2")
    stream: int  # request stream of its first round (the next rounds count up)


async def _search(
    deployments: list[_Deployment],
    cfg: HeadlineConfig,
    probes: _Probes,
    synth: TextSynth,
    points: Callable[[SystemResult], list[PointResult]],
    outputs: tuple[HeadlineResults, Provenance],
) -> None:
    """Each deployment's capacity by search (`capacity_search`: up from the start rate
    until attainment falls under the target, then bisect), one probe each per round,
    taking turns; a round's requests are the same for all, at each one's own rate.
    Each probe lands in `points(result)`."""
    searches = {d.result.name: CapacitySearch(probes.search) for d in deployments}
    for i in itertools.count():
        due = [(d, searches[d.result.name].next_rate()) for d in turns(deployments, i)]
        if all(rate is None for _, rate in due):
            return
        requests = make_requests(probes.traffic, synth, probes.num_requests, probes.stream + i)
        for d, rate in due:
            if rate is None:
                continue
            pace = _pace(d.result.name, rate, probes.stream + i, probes.duration_s, cfg)
            point = await d.measure(f"{probes.label}{rate:g}", requests, pace, cfg.slo)
            points(d.result).append(point)
            searches[d.result.name].record(as_probe(point))
        write_outputs(*outputs, plots=False)


async def _sweep(
    deployments: list[_Deployment],
    cfg: HeadlineConfig,
    mix: TrafficConfig,
    synth: TextSynth,
    results: HeadlineResults,
    provenance: Provenance,
) -> None:
    """The fixed rates, taking turns; a deployment sits out the rates above one whose
    attainment fell under `stop_below_attainment`."""
    rates = cfg.rate_list
    for i, rate in enumerate(rates):
        requests = make_requests(mix, synth, cfg.num_requests, stream=i + 1)
        for d in turns(deployments, i):
            if d.stopped:
                continue
            pace = _pace(d.result.name, rate, i, cfg.duration_s, cfg)
            point = await d.measure(f"{rate:g}", requests, pace, cfg.slo)
            d.result.points.append(point)
            if point.metrics.slo_attainment < cfg.stop_below_attainment:
                d.stopped = True
                d.result.skipped_rates = rates[i + 1 :]
        write_outputs(results, provenance, plots=False)


def run_headline(cfg: HeadlineConfig, traffic: TrafficConfig, model: RunSettings) -> Path:
    """Every deployment up at once, rate points interleaved, then the report; returns the
    markdown path."""
    provenance = collect_provenance(measures=MEASURES)
    synth = load_synth(model)
    mix = replace(traffic, workload="long_mix")
    results = HeadlineResults(
        created=now_iso(),
        config=cfg,
        traffic=mix,
        slo=cfg.slo,
        host_cpus=len(os.sched_getaffinity(0)),
    )
    results.systems = [
        SystemResult(n, cluster_config(n, cfg, model, cfg.elastic_roles)) for n in cfg.system_list
    ]
    with clusters_up([(r.name, r.cluster) for r in results.systems], "headline") as addresses:
        deployments = [_Deployment(r, a) for r, a in zip(results.systems, addresses, strict=True)]
        asyncio.run(_interleaved(deployments, cfg, mix, synth, results, provenance))
    return write_outputs(results, provenance, plots=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.headline.bench",
        description=__doc__.splitlines()[0] if __doc__ else "",
    )
    add_config_args(parser, HeadlineConfig)
    add_config_args(parser, TrafficConfig, exclude=("workload", "trace_path", "trace_time_scale"))
    add_settings_args(parser, ("model", "model_cache_dir"))
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(HeadlineConfig, args)
        traffic = config_from_args(TrafficConfig, args)
        settings = settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    summary = run_headline(cfg, traffic, settings)
    print(summary.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

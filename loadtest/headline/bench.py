"""The headline benchmark: disaggregated (1 prefill + 1 decode worker) against colocated
(2 mixed workers), one CPU core per worker, same router, model and workload; the
disaggregated gateway decides per request whether a prompt takes the prefill hop
(conditional disaggregation, `--local-prefill-max-tokens`).

Lifecycle: `run_headline(cfg, traffic, settings)` collects the run's provenance (commit,
time, host: it goes into headline.json), loads the tokenizer, starts both
deployments as `LocalCluster`s (embedded Redis, router placement, workers pinned to a
core each with one torch thread), sends each a few unmeasured requests, then finds each
one's capacity on the long-prompt interference mix by search (`capacity_search`: raise
the rate until attainment falls under the target, then bisect; so neither capacity is a
lower bound on whatever host it runs), the two taking turns at every round (Poisson;
identical request sequences for both; who goes first alternates). `--rates` instead
sweeps fixed rates, a deployment skipping those above one whose attainment fell under
`stop_below_attainment`. Then one short-prompt-only (chat) point on each, and both
clusters stop. Only one deployment carries load at a time. `report` then
derives each deployment's capacity (the highest rate holding the attainment target),
the ratio, the markdown and the plots. Results are rewritten after every rate, so an
interrupted run keeps what it measured.

Full run: `python -m loadtest.headline.bench` (about 40 minutes on the 2-core host);
`make bench` runs a short sweep.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from loadtest.harness.bench import load_synth, now_iso, warm_up
from loadtest.harness.bench_main import add_settings_args, settings_from_args
from loadtest.harness.bench_report import PointResult
from loadtest.harness.capacity_search import CapacitySearch, SearchConfig
from loadtest.harness.metrics import summarize
from loadtest.harness.request_spec import BenchRequest
from loadtest.harness.runner import Pace, run_point
from loadtest.harness.settings import RunSettings
from loadtest.harness.traffic import TrafficConfig, make_requests
from loadtest.headline.config import HeadlineConfig
from loadtest.headline.report import HeadlineResults, SystemResult, as_probe, write_outputs
from loadtest.reports.provenance import Provenance, collect_provenance
from loadtest.workloads.prompt_text import TextSynth
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from services.common.config import add_config_args, config_from_args

SYSTEMS = ("disaggregated", "colocated")
SHORT_STREAM = 10_000  # request stream of the short-only point (apart from the sweep's)


def cluster_config(name: str, cfg: HeadlineConfig, model: RunSettings) -> ClusterConfig:
    prefill, workers = (1, 1) if name == "disaggregated" else (0, 2)
    return ClusterConfig(
        num_prefill=prefill,
        num_decode=workers,
        gateway_port=0,
        worker_threads=1,
        worker_kv_cache_bytes=cfg.worker_kv_cache_bytes,
        kv_backend=cfg.kv_backend,
        model=model.model,
        model_cache_dir=model.model_cache_dir,
        placement="redis",
        max_streams=1024,
        pin_workers=cfg.pin_workers,
        dtype=cfg.dtype,
        # A flag: it also overrides a PDSERVE_LOCAL_PREFILL_MAX_TOKENS in the env.
        local_prefill_max_tokens=cfg.local_prefill_max_tokens if prefill else None,
        gateway_args="" if cfg.elastic_roles or not prefill else "--elastic-roles false",
    )


async def _point(
    address: str, label: str, requests: Sequence[BenchRequest], pace: Pace, cfg: HeadlineConfig
) -> PointResult:
    started = now_iso()
    records = await run_point(address, requests, pace)
    return PointResult(
        label=label,
        arrival="poisson",
        offered_rate=pace.rate,
        concurrency=None,
        started_at=started,
        metrics=summarize(records, cfg.slo),
        requests=records,
    )


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


class _Deployment:
    """One running cluster, its results so far, and the time its points took."""

    def __init__(self, result: SystemResult, address: str) -> None:
        self.result = result
        self.address = address
        self.stopped = False  # attainment fell under stop_below_attainment

    async def measure(
        self, label: str, requests: Sequence[BenchRequest], pace: Pace, cfg: HeadlineConfig
    ) -> PointResult:
        t0 = time.perf_counter()
        point = await _point(self.address, label, requests, pace, cfg)
        self.result.wall_s += time.perf_counter() - t0
        return point


def _turns(deployments: list[_Deployment], i: int) -> list[_Deployment]:
    """Who runs the i-th point first alternates, so a drift in the shared host's speed
    (it moves by tens of percent within an hour) falls on both deployments alike."""
    return deployments if i % 2 == 0 else deployments[::-1]


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
    for d in _turns(deployments, len(results.systems[0].points)):
        pace = _pace(d.result.name, cfg.short_rate, SHORT_STREAM, cfg.short_duration_s, cfg)
        d.result.short_only = await d.measure(f"chat {cfg.short_rate:g}", requests, pace, cfg)


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
    taking turns; a round's requests are the same for both, at each one's own rate.
    Each probe lands in `points(result)`."""
    searches = {d.result.name: CapacitySearch(probes.search) for d in deployments}
    for i in itertools.count():
        due = [(d, searches[d.result.name].next_rate()) for d in _turns(deployments, i)]
        if all(rate is None for _, rate in due):
            return
        requests = make_requests(probes.traffic, synth, probes.num_requests, probes.stream + i)
        for d, rate in due:
            if rate is None:
                continue
            pace = _pace(d.result.name, rate, probes.stream + i, probes.duration_s, cfg)
            point = await d.measure(f"{probes.label}{rate:g}", requests, pace, cfg)
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
        for d in _turns(deployments, i):
            if d.stopped:
                continue
            pace = _pace(d.result.name, rate, i, cfg.duration_s, cfg)
            point = await d.measure(f"{rate:g}", requests, pace, cfg)
            d.result.points.append(point)
            if point.metrics.slo_attainment < cfg.stop_below_attainment:
                d.stopped = True
                d.result.skipped_rates = rates[i + 1 :]
        write_outputs(results, provenance, plots=False)


def run_headline(cfg: HeadlineConfig, traffic: TrafficConfig, model: RunSettings) -> Path:
    """Both deployments up at once, rate points interleaved, then the report; returns the
    markdown path. The idle cluster only polls (its workers wait on an event), so it
    costs the measured one next to nothing."""
    provenance = collect_provenance()
    synth = load_synth(model)
    mix = replace(traffic, workload="long_mix")
    results = HeadlineResults(
        created=now_iso(),
        config=cfg,
        traffic=mix,
        slo=cfg.slo,
        host_cpus=len(os.sched_getaffinity(0)),
    )
    results.systems = [SystemResult(n, cluster_config(n, cfg, model)) for n in SYSTEMS]
    clusters = [LocalCluster(r.cluster) for r in results.systems]
    try:
        deployments = []
        for result, cluster in zip(results.systems, clusters, strict=True):
            address = cluster.start()
            print(f"headline: {result.name} cluster up at {address}", file=sys.stderr)
            deployments.append(_Deployment(result, address))
        asyncio.run(_interleaved(deployments, cfg, mix, synth, results, provenance))
    finally:
        for cluster in clusters:
            cluster.stop()
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

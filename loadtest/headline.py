"""The headline benchmark: disaggregated (1 prefill + 1 decode worker) against colocated
(2 mixed workers), one CPU core per worker, same router, model and workload.

Lifecycle: `run_headline(cfg, traffic, model)` loads the tokenizer, then for each
deployment in turn starts a `LocalCluster` (embedded Redis, router placement, workers
pinned to a core each with one torch thread), sends a few unmeasured requests, sweeps the
arrival rate of the long-prompt interference mix (Poisson; identical request sequences
and arrival gaps for both deployments; rates above one whose attainment fell under
`stop_below_attainment` are skipped), runs one short-prompt-only (chat) point, and stops
the cluster. `headline_report` then derives each deployment's capacity (the highest rate
holding the attainment target), the ratio, the markdown and the plots. Results are
rewritten after each deployment, so an interrupted run keeps what it measured.

Full run: `python -m loadtest.headline` (about 40 minutes on the 2-core host);
`make bench` runs a short sweep.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from loadtest.bench import ModelRef, load_synth, now_iso
from loadtest.headline_config import HeadlineConfig
from loadtest.headline_report import HeadlineResults, SystemResult, write_outputs
from loadtest.metrics import max_rate_at, summarize
from loadtest.prompt_text import TextSynth
from loadtest.report import PointResult
from loadtest.request_spec import BenchRequest
from loadtest.runner import Pace, run_point
from loadtest.traffic import TrafficConfig, make_requests
from services.cli.cluster import ClusterConfig, LocalCluster
from services.cli.model_cmd import ModelConfig
from services.common.config import add_config_args, config_from_args

SYSTEMS = ("disaggregated", "colocated")
SHORT_STREAM = 10_000  # request stream of the short-only point (apart from the sweep's)


def cluster_config(name: str, cfg: HeadlineConfig, model: ModelRef) -> ClusterConfig:
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


async def _sweep(
    result: SystemResult, address: str, cfg: HeadlineConfig, mix: TrafficConfig, synth: TextSynth
) -> None:
    def pace(rate: float, seed: int, n_s: float) -> Pace:
        return Pace(
            "poisson",
            rate=rate,
            duration_s=n_s,
            request_timeout_s=cfg.request_timeout_s,
            seed=seed,
            progress=cfg.progress,
            label=f"{result.name} {rate:g}/s",
        )

    if cfg.warmup_requests:
        warm = Pace(
            "closed",
            concurrency=1,
            duration_s=cfg.request_timeout_s,
            request_timeout_s=cfg.request_timeout_s,
            progress=False,
        )
        await run_point(address, make_requests(mix, synth, cfg.warmup_requests, stream=0), warm)
    rates = cfg.rate_list
    for i, rate in enumerate(rates):
        requests = make_requests(mix, synth, cfg.num_requests, stream=i + 1)
        point = await _point(address, f"{rate:g}", requests, pace(rate, i, cfg.duration_s), cfg)
        result.points.append(point)
        if point.metrics.slo_attainment < cfg.stop_below_attainment:
            result.skipped_rates = rates[i + 1 :]
            break
    chat = replace(mix, workload="chat")
    requests = make_requests(chat, synth, cfg.short_num_requests, stream=SHORT_STREAM)
    short_pace = pace(cfg.short_rate, SHORT_STREAM, cfg.short_duration_s)
    result.short_only = await _point(address, f"chat {cfg.short_rate:g}", requests, short_pace, cfg)


def run_system(
    name: str, cfg: HeadlineConfig, mix: TrafficConfig, synth: TextSynth, model: ModelRef
) -> SystemResult:
    """Start the deployment, sweep it, stop it (whatever happens)."""
    result = SystemResult(name, cluster_config(name, cfg, model))
    t0 = time.perf_counter()
    cluster = LocalCluster(result.cluster)
    try:
        address = cluster.start()
        print(f"headline: {name} cluster up at {address}", file=sys.stderr)
        asyncio.run(_sweep(result, address, cfg, mix, synth))
    finally:
        cluster.stop()
    result.wall_s = time.perf_counter() - t0
    points = [(p.rate, p.metrics.slo_attainment) for p in result.points]
    result.capacity_rate, result.capacity_qualifier = max_rate_at(points, cfg.attainment_target)
    return result


def run_headline(cfg: HeadlineConfig, traffic: TrafficConfig, model: ModelRef) -> Path:
    """Both deployments, then the report; returns the markdown path."""
    synth = load_synth(model)
    mix = replace(traffic, workload="long_mix")
    results = HeadlineResults(
        created=now_iso(),
        config=cfg,
        traffic=mix,
        slo=cfg.slo,
        host_cpus=len(os.sched_getaffinity(0)),
    )
    for name in SYSTEMS:
        results.systems.append(run_system(name, cfg, mix, synth, model))
        write_outputs(results, plots=False)
    return write_outputs(results, plots=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.headline", description=__doc__.splitlines()[0] if __doc__ else ""
    )
    add_config_args(parser, HeadlineConfig)
    add_config_args(parser, TrafficConfig, exclude=("workload", "trace_path", "trace_time_scale"))
    add_config_args(parser, ModelConfig)
    args = parser.parse_args(argv)
    cfg = config_from_args(HeadlineConfig, args)
    traffic = config_from_args(TrafficConfig, args)
    model = config_from_args(ModelConfig, args)
    summary = run_headline(cfg, traffic, ModelRef(model.model, model.model_cache_dir))
    print(summary.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

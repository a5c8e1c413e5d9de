"""`pdserve-bench` / `python -m loadtest`: load one gateway, point by point, and report.

Lifecycle: `run_bench(cfg, traffic, settings)` collects the run's provenance, loads the
tokenizer of the settings' model (for prompt text of known token lengths), sends
`warmup_requests` unmeasured requests one at a time, then runs one point per arrival
rate (Poisson; a trace's own timestamps) or per concurrency level (closed loop), each
with fresh requests of the workload, bounded by `num_requests` and `duration_s`. After
every point it rewrites `results.json` (with the provenance); at the end it draws the
plots (TTFT and ITL CDFs per point, goodput and SLO attainment against the rate) and
writes `summary.md` next to them. It never starts or stops a cluster.
"""

from __future__ import annotations

import asyncio
import datetime
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from engine.model_store import resolve_model_dir
from engine.tokenizer import Tokenizer
from loadtest.harness.bench_config import BenchConfig
from loadtest.harness.bench_report import BenchResults, PointResult, write_markdown
from loadtest.harness.cost import ClusterCost, NodeCosts, count_workers
from loadtest.harness.metrics import RequestRecord, summarize
from loadtest.harness.runner import Pace, run_point
from loadtest.harness.settings import RunSettings
from loadtest.harness.traffic import TrafficConfig, make_requests
from loadtest.reports.plots import cdf_plot, curve_plot
from loadtest.reports.provenance import collect_provenance
from loadtest.reports.result_file import ResultFile
from loadtest.reports.sources import SERVING_STACK
from loadtest.workloads.prompt_text import TextSynth

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (*SERVING_STACK, "loadtest/harness", "loadtest/workloads")


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def load_synth(settings: RunSettings) -> TextSynth:
    """Prompt text sized by the tokenizer of the model the cluster serves."""
    cache = settings.model_cache_dir.expanduser()
    model_dir = resolve_model_dir(settings.model, cache, progress=True)
    return TextSynth.from_tokenizer(Tokenizer(model_dir))


def point_paces(cfg: BenchConfig) -> list[tuple[str, Pace]]:
    """(label, pace) of every point of the sweep, in order."""
    base = Pace(
        "closed",
        concurrency=1,
        duration_s=cfg.duration_s,
        request_timeout_s=cfg.request_timeout_s,
        seed=cfg.arrival_seed,
        ignore_eos=cfg.ignore_eos,
        progress=cfg.progress,
    )
    if cfg.arrival == "closed":
        return [
            (f"c={c}", replace(base, concurrency=c, label=f"c={c}")) for c in cfg.concurrency_list
        ]
    return [
        (
            f"rate={r:g}",
            replace(base, arrival="poisson", rate=r, concurrency=0, label=f"rate={r:g}"),
        )
        for r in cfg.rate_list
    ]


class WarmupSettings(Protocol):
    """What `warm_up` reads: BenchConfig and HeadlineConfig both have it."""

    @property
    def warmup_requests(self) -> int: ...

    @property
    def request_timeout_s(self) -> float: ...


async def warm_up(
    address: str, cfg: WarmupSettings, traffic: TrafficConfig, synth: TextSynth
) -> list[RequestRecord]:
    """Unmeasured requests one at a time: loads kernels and the first prefixes."""
    if not cfg.warmup_requests:
        return []
    requests = make_requests(traffic, synth, cfg.warmup_requests, stream=0)
    pace = Pace(
        "closed",
        concurrency=1,
        duration_s=cfg.request_timeout_s,
        request_timeout_s=cfg.request_timeout_s,
        progress=False,
    )
    return await run_point(address, requests, pace)


async def run_points(
    address: str,
    cfg: BenchConfig,
    traffic: TrafficConfig,
    synth: TextSynth,
    results: BenchResults,
    result_file: ResultFile | None = None,
) -> None:
    """Run every point of the sweep into `results` (rewriting `result_file` after each)."""
    for i, (label, pace) in enumerate(point_paces(cfg)):
        requests = make_requests(traffic, synth, cfg.num_requests, stream=i + 1)
        started = now_iso()
        records = await run_point(address, requests, pace)
        stamped = all(r.at_s is not None for r in requests)
        offered = None if pace.arrival == "closed" else (None if stamped else pace.rate)
        results.points.append(
            PointResult(
                label=label,
                arrival="trace" if stamped else pace.arrival,
                offered_rate=offered,
                concurrency=pace.concurrency if pace.arrival == "closed" else None,
                started_at=started,
                metrics=summarize(records, cfg.slo),
                requests=records,
            )
        )
        if result_file is not None:
            result_file.write(results)


def plot_points(out_dir: Path, points: list[PointResult], cfg: BenchConfig) -> dict[str, str]:
    """The four plots of a sweep; returns name -> file name (relative to out_dir)."""
    ttft = {
        p.label: [1000 * t for r in p.requests if r.ok and (t := r.ttft_s) is not None]
        for p in points
    }
    itl = {p.label: [1000 * g for r in p.requests if r.ok for g in r.token_gaps_s] for p in points}
    slo = cfg.slo
    cdf_plot(
        out_dir / "ttft_cdf.png",
        ttft,
        title="TTFT",
        xlabel="ms",
        slo=None if slo.ttft_ms_per_token else slo.ttft_ms,
    )
    cdf_plot(out_dir / "itl_cdf.png", itl, title="Inter-token latency", xlabel="ms", slo=slo.itl_ms)
    xlabel = "arrival rate (req/s)"
    curve_plot(
        out_dir / "goodput_vs_rate.png",
        {
            "goodput": [(p.rate, p.metrics.goodput) for p in points],
            "throughput": [(p.rate, p.metrics.request_throughput) for p in points],
        },
        title="Goodput (requests within the SLO per s)",
        xlabel=xlabel,
        ylabel="req/s",
    )
    curve_plot(
        out_dir / "attainment_vs_rate.png",
        {"SLO attainment": [(p.rate, p.metrics.slo_attainment) for p in points]},
        title="SLO attainment",
        xlabel=xlabel,
        ylabel="fraction of requests",
        target=0.9,
        unit_interval=True,
    )
    names = ("ttft_cdf", "itl_cdf", "goodput_vs_rate", "attainment_vs_rate")
    return {name: f"{name}.png" for name in names}


async def price_cluster(cfg: BenchConfig) -> ClusterCost:
    """The cluster's workers (ClusterStatus) at `--node-cost-per-hour`."""
    workers = await count_workers(cfg.gateway)
    return ClusterCost(workers, NodeCosts.parse(cfg.node_cost_per_hour).per_hour(workers))


def run_bench(cfg: BenchConfig, traffic: TrafficConfig, settings: RunSettings) -> BenchResults:
    """The whole `pdserve-bench` run; writes results.json, summary.md and the PNGs."""
    result_file = ResultFile(cfg.out_dir / "results.json", collect_provenance(measures=MEASURES))
    synth = load_synth(settings)
    results = BenchResults(created=now_iso(), bench=cfg, traffic=traffic, slo=cfg.slo)

    async def go() -> None:
        if cfg.node_cost_per_hour:  # priced before the run: a refused status fails fast
            results.cost = await price_cluster(cfg)
        await warm_up(cfg.gateway, cfg, traffic, synth)
        await run_points(cfg.gateway, cfg, traffic, synth, results, result_file)

    asyncio.run(go())
    results.plots = plot_points(cfg.out_dir, results.points, cfg)
    result_file.write(results)
    write_markdown(cfg.out_dir / "summary.md", results)
    return results

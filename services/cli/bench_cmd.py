"""`pdserve bench`: the load generator against a running gateway (see `loadtest.bench`)."""

from __future__ import annotations

import argparse
import sys

from loadtest.bench_config import BenchConfig
from loadtest.traffic import TrafficConfig
from services.cli.model_cmd import ModelConfig
from services.common.config import add_config_args, config_from_args


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser(
        "bench",
        help="load a gateway (Poisson or closed loop) and report latency, goodput and plots",
    )
    add_config_args(bench, BenchConfig)
    add_config_args(bench, TrafficConfig)
    add_config_args(bench, ModelConfig)
    bench.set_defaults(handler=_bench)


def _bench(args: argparse.Namespace) -> int:
    from loadtest.bench import ModelRef, run_bench
    from loadtest.report import point_row

    cfg = config_from_args(BenchConfig, args)
    traffic = config_from_args(TrafficConfig, args)
    model = config_from_args(ModelConfig, args)
    results = run_bench(cfg, traffic, ModelRef(model.model, model.model_cache_dir))
    for p in results.points:
        print(point_row(p.label, p.metrics))
    print(
        f"pdserve bench: results in {cfg.out_dir}/ (results.json, summary.md, *.png)",
        file=sys.stderr,
    )
    return 1 if any(p.metrics.sent and not p.metrics.ok for p in results.points) else 0

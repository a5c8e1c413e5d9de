"""`pdserve-bench` (also `python -m loadtest`): the load generator against a running
gateway (see `loadtest.harness.bench`).

loadtest is a client of the cluster, beside the `pdserve` CLI rather than under it: the
services never import it, so the bench command has its own console script.
"""

from __future__ import annotations

import argparse
import logging
import sys

from loadtest.harness.bench_config import BenchConfig
from loadtest.harness.bench_main import add_settings_args, settings_from_args
from loadtest.harness.traffic import TrafficConfig
from services.common.config import add_config_args, config_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve-bench",
        description="Load a gateway (Poisson or closed loop) and report latency, goodput "
        "and plots.",
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    add_config_args(parser, BenchConfig)
    add_config_args(parser, TrafficConfig)
    add_settings_args(parser, ("model", "model_cache_dir"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    from loadtest.harness.bench import run_bench
    from loadtest.harness.bench_report import point_row

    try:
        cfg = config_from_args(BenchConfig, args)
        traffic = config_from_args(TrafficConfig, args)
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"pdserve-bench: error: {exc}", file=sys.stderr)
        return 2
    results = run_bench(cfg, traffic, settings)
    for p in results.points:
        print(point_row(p.label, p.metrics))
    print(
        f"pdserve-bench: results in {cfg.out_dir}/ (results.json, summary.md, *.png)",
        file=sys.stderr,
    )
    return 1 if any(p.metrics.sent and not p.metrics.ok for p in results.points) else 0

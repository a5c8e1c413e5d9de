"""KV-transfer benchmark: NIXL and the TCP fallback between two processes, against memcpy.

Lifecycle of one run (`python -m loadtest.transfer.bench`):

1. Flags become the run's `RunSettings` and a frozen `TransferBenchConfig`
   (`bench_main`). Only the default model's KV layout is needed (its config.json, no
   weights are loaded): fp32, 16-token blocks, like a CPU engine.
2. An exporter process is started (`peer.ExporterPeer` running
   `loadtest.transfer.exporter`): a patterned pool served by one real `KvExporter` per
   backend (nixl, tcp).
3. This process builds its own pool and measures (`measure`): per prompt size
   and block pattern, verified imports over each backend interleaved with the
   single-thread memcpy baseline (torch threads are set to 1 for the run and restored),
   and NIXL imports checked against the exporter's checksums beside plain ones, then
   the one-block import overhead.
4. Every lease must end by release (none expired, none left active); the links are
   closed and the exporter stopped on every exit path (killed if it does not stop;
   SIGTERM included). `report` holds the numbers to the targets; `bench_main`
   writes the report to `--out` as JSON with the run's provenance and prints the table.
   The exit code is 0 whether or not targets are met.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import torch

from engine.kv_layout import KvLayout
from engine.model_store import prepare_default_model
from loadtest.harness.bench_main import BenchSpec, run_main
from loadtest.harness.bench_main import parse_args as parse_bench_args
from loadtest.harness.settings import RunSettings
from loadtest.transfer.config import TransferBenchConfig
from loadtest.transfer.exporter import layout_for
from loadtest.transfer.measure import (
    CaseResult,
    OneBlockResult,
    make_rig,
    measure_all,
    progress,
    wait_leases_settled,
)
from loadtest.transfer.peer import ExporterPeer, LeaseCounts
from loadtest.transfer.report import (
    SCHEMA,
    TransferReport,
    evaluate_targets,
    format_table,
    layout_info,
    machine_info,
)

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (
    "kvtransfer",
    "engine/kv_layout.py",
    "engine/kv_handoff.py",
    "loadtest/transfer",
)


def _run_measurements(
    settings: RunSettings, cfg: TransferBenchConfig, layout: KvLayout, model_dir: Path
) -> tuple[list[CaseResult], list[OneBlockResult], dict[str, LeaseCounts], int]:
    """Start the exporter, measure, and stop everything on every exit path."""
    peer = ExporterPeer(model_dir, cfg.num_blocks, cfg.peer_timeout_s)
    progress(f"exporter process {peer.proc.pid} serving {cfg.num_blocks} blocks")
    try:
        rig = make_rig(cfg, settings.seed, layout, peer)
        try:
            cases, one_block = measure_all(rig)
        finally:
            for link in rig.links.values():
                link.backend.close()
                link.releaser.close()
            rig.checker.close()
        return cases, one_block, wait_leases_settled(peer), peer.proc.pid
    finally:
        peer.close()


def run(settings: RunSettings, cfg: TransferBenchConfig) -> TransferReport:
    """Measure every size and pattern, then the one-block overhead; returns the report."""
    started, t0 = datetime.now(UTC), time.perf_counter()
    cfg = replace(cfg, tcp_reps=cfg.tcp_rep_count)  # the report records the count used
    load_start = list(os.getloadavg())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the baseline is a single-thread copy
    try:
        model_dir = prepare_default_model(settings.model_cache_dir.expanduser(), progress=False)
        layout = layout_for(model_dir)
        cases, one_block, leases, pid = _run_measurements(settings, cfg, layout, model_dir)
        machine = machine_info(load_start)
    finally:
        torch.set_num_threads(threads)
    targets = evaluate_targets(cases, one_block)
    clean = all(c.active == c.expired == 0 and c.released == c.granted for c in leases.values())
    verified = all(all(c.verified.values()) for c in cases) and all(o.verified for o in one_block)
    return TransferReport(
        schema=SCHEMA,
        started_at=started.isoformat(),
        finished_at=datetime.now(UTC).isoformat(),
        wall_s=time.perf_counter() - t0,
        model_dir=str(model_dir),
        exporter_pid=pid,
        machine=machine,
        layout=layout_info(layout, cfg.num_blocks),
        settings=settings,
        config=cfg,
        cases=cases,
        one_block=one_block,
        leases=leases,
        verified=verified,
        leases_clean=clean,
        targets=targets,
        # A wrong byte or a stranded lease fails the run whatever its speed.
        targets_met=verified and clean and bool(targets) and all(t.met for t in targets),
    )


SPEC = BenchSpec(
    name="transfer",
    module="loadtest.transfer.bench",
    description="KV transfer GB/s over NIXL and the TCP fallback between two processes, "
    "as ratios against a single-thread memcpy measured in the same run.",
    config=TransferBenchConfig,
    run=run,
    table=format_table,
    settings=("out", "seed", "model_cache_dir"),
    measures=MEASURES,
)


def parse_args(argv: Sequence[str] | None = None) -> tuple[RunSettings, TransferBenchConfig]:
    return parse_bench_args(SPEC, argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())

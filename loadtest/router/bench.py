"""Router benchmark: decision latency against Redis PING, prefix-hit rate per policy, and
placement with 1 to 8 router replicas sharing one Redis.

Lifecycle of one run (`python -m loadtest.router.bench`):

1. Flags become the run's `RunSettings` and a frozen `RouterBenchConfig` (`bench_main`).
   A seeded multi-tenant chat workload is drawn (`loadtest.workloads.prefix`: T tenants x
   P system prompts, Zipf(1.1) popularity, a unique user suffix per request). An
   embedded `redis-server` is started on a free 127.0.0.1 port (TCP loopback, as a
   cluster's Redis would be reached); it is stopped on every exit path, SIGTERM included.
2. Latency, per pool shape (`latency`; `mixed`: 8 mixed workers, one Lua
   placement per decision; `pd`: 8 prefill + 8 decode, two placements pipelined in one
   round trip), against PING on the same connection, interleaved.
3. Hit rate, per policy (`hit_rate`): the same request sequence routed through
   the real `Router` with a sliding window of W in-flight requests, each worker's LRU
   prefix cache simulated (capacity = `cache_factor` x the shared system-prompt blocks /
   workers), against the greedy cache-aware oracle (free and held to the load bound)
   and an unlimited-cache upper bound. Every lease is released and the pool checked empty.
4. Residency (`residency`): the bounded router placing by the caches the simulated
   workers report, against the same router on its own cache model and against the
   bound-held oracle, with workers restarting empty mid-run.
5. Scale (`scale`): 1, 2, 4 and 8 router replicas, each its own process as each gateway
   is, against the same Redis: pdserve's shared state against per-replica state (the
   same router, one namespace per replica), measured in the same run.
6. `report` holds the numbers to the targets; the report goes to `--out` as JSON
   with the run's provenance and the table is printed. The exit code is 0 whether or not
   targets are met.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime

from loadtest.harness.bench_main import BenchSpec, Progress, run_main
from loadtest.harness.bench_main import parse_args as parse_bench_args
from loadtest.harness.settings import RunSettings
from loadtest.router.config import RouterBenchConfig
from loadtest.router.hit_rate import measure_hit_rates
from loadtest.router.latency import LatencyResult, RoundTripCounter, measure_latency
from loadtest.router.report import (
    SCHEMA,
    MachineInfo,
    RouterReport,
    evaluate_targets,
    format_table,
    machine_info,
)
from loadtest.router.residency import ResidencyResult, measure_residency
from loadtest.router.scale import measure_scale
from loadtest.workloads.prefix import HitRateResult, Workload, make_workload
from services.router.embedded_redis import EmbeddedRedis
from services.router.redis_client import connect

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (
    "services/router",
    "engine/prefix_hash.py",
    "loadtest/router",
    "loadtest/workloads/prefix.py",
)

progress = Progress("router_bench")


def _measure(
    server: EmbeddedRedis, cfg: RouterBenchConfig, wl: Workload, load_start: list[float]
) -> tuple[list[LatencyResult], HitRateResult, ResidencyResult, MachineInfo]:
    client = connect(server.url, timeout_s=5.0)
    counter = RoundTripCounter()
    counter.install(client)
    try:
        latency = []
        for shape in cfg.pool_shapes:
            latency.append(measure_latency(client, counter, shape, cfg.latency_plan(), wl))
            progress(f"latency {shape}: route p50 {latency[-1].route.p50_ms:.3f} ms")
        hits = measure_hit_rates(client, wl, cfg.sim_config(wl), cfg.policy_names, eps=cfg.eps,
                                 prefix_blocks=cfg.prefix_blocks, progress=progress)  # fmt: skip
        residency = measure_residency(
            client, wl, cfg.sim_config(wl), eps=cfg.eps, prefix_blocks=cfg.prefix_blocks,
            restarts=cfg.restarts, report_every=cfg.report_every, progress=progress,
        )  # fmt: skip
        return latency, hits, residency, machine_info(client, load_start)
    finally:
        client.close()


def run(settings: RunSettings, cfg: RouterBenchConfig) -> RouterReport:
    started, t0 = datetime.now(UTC), time.perf_counter()
    load_start = list(os.getloadavg())
    workload = cfg.workload(settings.seed)
    wl = make_workload(workload)
    with EmbeddedRedis(tcp=True) as server:
        pid = server.pid or 0
        progress(f"redis-server pid {pid} at {server.url}")
        latency, hits, residency, machine = _measure(server, cfg, wl, load_start)
        scale = measure_scale(
            server.url, wl, cfg.sim_config(wl), cfg.replica_counts, eps=cfg.eps,
            prefix_blocks=cfg.prefix_blocks, progress=progress,
        )  # fmt: skip
    scale = [replace(r, vs_oracle=r.hit_ratio / max(hits.oracle.hit_ratio, 1e-12)) for r in scale]
    targets = evaluate_targets(latency, hits, scale, residency)
    # A lease left behind or a decision that failed open fails the run whatever its speed.
    clean = (
        all(p.leases_left == 0 and p.fail_open == 0 for p in hits.policies)
        and all(r.fail_open == 0 for r in latency)
        and all(r.leases_left == 0 and r.fail_open == 0 for r in scale)
        and all(p.leases_left == 0 and p.fail_open == 0
                for p in (residency.reported, residency.modelled))
    )  # fmt: skip
    return RouterReport(
        schema=SCHEMA,
        started_at=started.isoformat(),
        finished_at=datetime.now(UTC).isoformat(),
        wall_s=time.perf_counter() - t0,
        redis_pid=pid,
        machine=machine,
        settings=settings,
        config=cfg,
        workload=workload,
        latency=latency,
        hit_rate=hits,
        scale=scale,
        residency=residency,
        targets=targets,
        targets_met=clean and all(t.met for t in targets),
    )


SPEC = BenchSpec(
    name="router",
    module="loadtest.router.bench",
    description="Router decision latency against Redis PING, the prefix-hit rate of "
    "each placement policy against a cache-aware oracle, placement by the workers' "
    "reported caches against the router's own model, and 1-8 router replicas on one "
    "Redis against per-replica state.",
    config=RouterBenchConfig,
    run=run,
    table=format_table,
    settings=("out", "seed"),
    measures=MEASURES,
)


def parse_args(argv: Sequence[str] | None = None) -> tuple[RunSettings, RouterBenchConfig]:
    return parse_bench_args(SPEC, argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())

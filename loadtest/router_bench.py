"""Router benchmark: decision latency against Redis PING, and prefix-hit rate per policy.

Lifecycle of one run (`python -m loadtest.router_bench`):

1. Flags become a frozen `BenchConfig`. A seeded multi-tenant chat workload is drawn
   (`loadtest.prefix_workload`: T tenants x P system prompts, Zipf(1.1) popularity, a
   unique user suffix per request). An embedded `redis-server` is started on a free
   127.0.0.1 port (TCP loopback, as a cluster's Redis would be reached); it is stopped on
   every exit path, SIGTERM included.
2. Latency, per pool shape (`mixed`: 8 mixed workers, one Lua placement per decision;
   `pd`: 8 prefill + 8 decode, two placements pipelined in one round trip): workers are
   registered in a fresh namespace and one `Router` replica runs warm-up then N cycles of
   release-the-oldest (W leases held), route, PING. PING on the same connection is the
   baseline, interleaved so the shared machine's noise hits both; ratios are reported
   beside the absolute numbers. Round trips are counted client side (one per command or
   pipeline written); `INFO commandstats` deltas say what the server ran.
3. Hit rate: per policy, 8 mixed workers in a fresh namespace, the same request sequence
   routed through the real `Router` with a sliding window of W in-flight requests, and
   each worker's LRU prefix cache simulated (capacity = `cache_factor` x the shared
   system-prompt blocks / workers). The greedy cache-aware oracle (and the same held to
   the load bound) and an unlimited-cache upper bound are computed on the same sequence.
   Every lease is released and the pool checked empty.
4. A table is printed and everything goes to `--out` as JSON, with targets met or not.
   The exit code is 0 whether or not targets are met.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import signal
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import redis

from loadtest.prefix_workload import (
    ChatRequest,
    ClusterSim,
    HitRateResult,
    PolicyResult,
    SimConfig,
    Workload,
    WorkloadConfig,
    hit_rate_rows,
    make_workload,
    run_policy,
    summarize,
)
from services.common.role import Role
from services.router.embedded_redis import EmbeddedRedis
from services.router.keyspace import Keyspace
from services.router.redis_client import connect
from services.router.registry import Registry, WorkerInfo
from services.router.router import Router
from services.router.router_config import POLICIES, RouterConfig

SCHEMA = "pdserve.router_bench/1"
LAYOUT = "bench-layout"
POOL_SHAPES = {"mixed": ("mixed",), "pd": ("prefill", "decode")}
#: The issue's targets.
TARGET_ROUTE_P99_MS = 1.0
TARGET_ROUND_TRIPS = 2.0
TARGET_VS_ORACLE = 0.9
#: Registrations outlive the run: no heartbeat task runs here.
REGISTRATION_TTL_S = 3600.0


@dataclass(frozen=True)
class BenchConfig:
    """Everything one run depends on; recorded verbatim in the JSON."""

    decisions: int = 5000  # measured route+release cycles per pool shape
    latency_warmup: int = 300
    latency_inflight: int = 16  # leases held during the latency cycles
    pools: tuple[str, ...] = ("mixed", "pd")
    workers: int = 8  # per pool
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    window: int = 64  # in-flight requests in the hit-rate replay
    warmup_requests: int = 2000
    cache_factor: float = 1.5  # all workers' cache blocks / the system prompts' blocks
    eps: float = 0.25
    prefix_blocks: int = 4
    policies: tuple[str, ...] = POLICIES
    out: Path = Path("bench-results/router.json")

    def __post_init__(self) -> None:
        if self.decisions < 1 or self.latency_warmup < 0 or self.latency_inflight < 1:
            raise ValueError("need decisions >= 1, latency_warmup >= 0, latency_inflight >= 1")
        if not self.pools or any(p not in POOL_SHAPES for p in self.pools):
            raise ValueError(f"pools must be among {tuple(POOL_SHAPES)}, got {self.pools}")
        if not self.policies or any(p not in POLICIES for p in self.policies):
            raise ValueError(f"policies must be among {POLICIES}, got {self.policies}")
        if self.cache_factor <= 0:
            raise ValueError(f"cache_factor must be > 0, got {self.cache_factor}")
        if self.warmup_requests >= self.workload.requests:
            raise ValueError("warmup_requests must leave some requests to measure")
        SimConfig(self.workers, 1, self.window, self.warmup_requests)  # validates the rest

    def sim_config(self, workload: Workload) -> SimConfig:
        capacity = math.ceil(self.cache_factor * workload.hot_blocks / self.workers)
        return SimConfig(self.workers, max(1, capacity), self.window, self.warmup_requests)


class RoundTripCounter:
    """Counts what a client writes to Redis: one per command, one per pipeline execute."""

    def __init__(self) -> None:
        self.count = 0

    def install(self, client: redis.Redis) -> None:
        """Make every connection `client` opens from now on count its writes."""
        pool = client.connection_pool
        if pool.connection_class is not redis.Connection:
            raise ValueError("round trips are counted on plain TCP connections only")
        counter = self

        class CountingConnection(redis.Connection):
            def send_packed_command(self, command: Any, check_health: bool = True) -> None:
                counter.count += 1
                super().send_packed_command(command, check_health)

        pool.connection_class = CountingConnection
        pool.disconnect()  # connections opened before this would not count


@dataclass(frozen=True)
class Percentiles:
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Percentiles:
        ms = np.asarray(seconds) * 1e3
        p50, p99 = np.percentile(ms, [50, 99])
        return cls(float(p50), float(p99), float(ms.mean()), float(ms.max()))


@dataclass(frozen=True)
class LatencyResult:
    pool: str
    workers: dict[str, int]
    decisions: int
    route: Percentiles
    release: Percentiles
    ping: Percentiles  # the baseline: one Redis round trip on the same connection
    route_vs_ping_p50: float
    route_vs_ping_p99: float
    release_vs_ping_p50: float
    decisions_per_s: float  # one thread, sequential: decisions / (route + release seconds)
    pings_per_s: float  # the same thread's PING rate: a Redis-bound ceiling, for scale
    round_trips_per_route: float
    round_trips_per_route_max: int  # a route that re-reads membership (every 1 s) makes 3
    round_trips_per_release: float
    server_commands: dict[str, int]  # INFO commandstats call deltas (scripts' calls too)
    server_usec_per_evalsha: float
    fail_open: int


@dataclass(frozen=True)
class TargetResult:
    name: str
    measured: float
    threshold: float
    comparison: str
    met: bool
    context: str = ""  # the same run's baseline, to tell a slow router from a noisy host


@dataclass(frozen=True)
class MachineInfo:
    cpu_count: int
    loadavg_start: list[float]
    loadavg_end: list[float]
    python: str
    platform: str
    redis_server: str
    redis_py: str


@dataclass(frozen=True)
class BenchReport:
    schema: str
    started_at: str
    finished_at: str
    wall_s: float
    redis_pid: int
    machine: MachineInfo
    config: BenchConfig
    latency: list[LatencyResult]
    hit_rate: HitRateResult
    targets: list[TargetResult]
    targets_met: bool


# -- cluster setup --------------------------------------------------------------------
def register_workers(
    client: redis.Redis, namespace: str, roles: Sequence[str], n: int, model: str, capacity: int
) -> list[str]:
    """Register n workers per role (no heartbeat: the TTL outlives the run)."""
    registry = Registry(client, Keyspace(namespace), ttl_s=REGISTRATION_TTL_S)
    ids = []
    for role in roles:
        for i in range(n):
            wid = f"{role}-{i}"
            # Never dialed: placement only needs ids; .invalid says so to any reader.
            registry.register(
                WorkerInfo(wid, Role(role), model, LAYOUT, f"{wid}.invalid:0", capacity)
            )
            ids.append(wid)
    return ids


def make_router(client: redis.Redis, namespace: str, policy: str, cfg: BenchConfig) -> Router:
    wl = cfg.workload
    config = RouterConfig(
        namespace=namespace, policy=policy, eps=cfg.eps, prefix_blocks=cfg.prefix_blocks,
        block_size=wl.block_size, model_fingerprint=wl.model, seed=wl.seed,
    )  # fmt: skip
    router = Router(client, config)
    if not router.refresh():
        raise RuntimeError("the benchmark's Redis is unreachable")
    return router


# -- latency --------------------------------------------------------------------------
@dataclass
class _Samples:
    route: list[float] = field(default_factory=list)
    release: list[float] = field(default_factory=list)
    ping: list[float] = field(default_factory=list)
    route_trips: list[int] = field(default_factory=list)
    release_trips: list[int] = field(default_factory=list)


def _cycles(
    router: Router, counter: RoundTripCounter, requests: Sequence[ChatRequest], held: int, skip: int
) -> _Samples:
    """Per request: release the oldest held decision (once `held` are held), route, PING;
    samples after the first `skip` cycles. Releases everything it routed."""
    s = _Samples()
    inflight: deque[tuple[str, ...]] = deque()
    clock = time.perf_counter
    try:
        for i, req in enumerate(requests):
            keep = i >= skip
            if len(inflight) >= held:
                leases, c0, t0 = inflight.popleft(), counter.count, clock()
                router.release(leases)
                t1, c1 = clock(), counter.count
                if keep:
                    s.release.append(t1 - t0)
                    s.release_trips.append(c1 - c0)
            c0, t0 = counter.count, clock()
            decision = router.route(req.request_id, req.tokens, req.tenant)
            t1, c1 = clock(), counter.count
            inflight.append(decision.load_lease_ids)
            router.client.ping()
            t2 = clock()
            if keep:
                s.route.append(t1 - t0)
                s.route_trips.append(c1 - c0)
                s.ping.append(t2 - t1)
    finally:
        while inflight:
            router.release(inflight.popleft())
    return s


def command_calls(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """INFO commandstats: command -> (calls, usec)."""
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in stats.items()}


def measure_latency(
    client: redis.Redis, counter: RoundTripCounter, shape: str, cfg: BenchConfig, wl: Workload
) -> LatencyResult:
    roles = POOL_SHAPES[shape]
    namespace = f"bench-latency-{shape}-{uuid.uuid4().hex[:8]}"
    register_workers(client, namespace, roles, cfg.workers, wl.config.model, 0)
    router = make_router(client, namespace, "bounded", cfg)
    total = cfg.latency_warmup + cfg.decisions
    requests = [wl.requests[i % len(wl.requests)] for i in range(total)]
    _cycles(router, counter, requests[: cfg.latency_warmup], cfg.latency_inflight, total)
    before = command_calls(client)
    s = _cycles(router, counter, requests[cfg.latency_warmup :], cfg.latency_inflight, 0)
    after = command_calls(client)
    deltas = {k: v[0] - before.get(k, (0, 0))[0] for k, v in after.items() if k != "info"}
    evalsha_usec = after.get("evalsha", (0, 0))[1] - before.get("evalsha", (0, 0))[1]
    route, release, ping = (Percentiles.of(x) for x in (s.route, s.release, s.ping))
    return LatencyResult(
        pool=shape,
        workers={r: cfg.workers for r in roles},
        decisions=len(s.route),
        route=route,
        release=release,
        ping=ping,
        route_vs_ping_p50=route.p50_ms / ping.p50_ms,
        route_vs_ping_p99=route.p99_ms / ping.p99_ms,
        release_vs_ping_p50=release.p50_ms / ping.p50_ms,
        decisions_per_s=len(s.route) / (sum(s.route) + sum(s.release)),
        pings_per_s=len(s.ping) / sum(s.ping),
        round_trips_per_route=float(np.mean(s.route_trips)),
        round_trips_per_route_max=max(s.route_trips),
        round_trips_per_release=float(np.mean(s.release_trips)) if s.release_trips else 0.0,
        server_commands={k: v for k, v in sorted(deltas.items()) if v},
        server_usec_per_evalsha=evalsha_usec / max(1, deltas.get("evalsha", 0)),
        fail_open=router.stats.fail_open,
    )


# -- hit rate -------------------------------------------------------------------------
class RouterPlacer:
    """`Placer` over the real router; worker ids map to the simulation's indices."""

    def __init__(self, router: Router, worker_ids: Sequence[str]) -> None:
        self.router = router
        self.name = router.config.policy
        self.index = {w: i for i, w in enumerate(worker_ids)}
        self.ranks: list[int] = []  # per decision: index of the pick in the policy's order

    def place(self, request: ChatRequest, sim: ClusterSim) -> tuple[int, tuple[str, ...]]:
        routed = self.router.route_detailed(request.request_id, request.tokens, request.tenant)
        self.ranks.append(max(p.rank for p in routed.placements))
        return self.index[routed.decision.decode.worker_id], routed.decision.load_lease_ids

    def release(self, leases: tuple[str, ...]) -> None:
        self.router.release(leases)


def run_router_policy(
    client: redis.Redis, policy: str, cfg: BenchConfig, wl: Workload, sim: SimConfig
) -> PolicyResult:
    """Replay the workload through a fresh router and pool; every lease must be released."""
    namespace = f"bench-hit-{policy}-{uuid.uuid4().hex[:8]}"
    ids = register_workers(client, namespace, ("mixed",), sim.workers, wl.config.model,
                           sim.capacity_blocks)  # fmt: skip
    router = make_router(client, namespace, policy, cfg)
    placer = RouterPlacer(router, ids)
    result = run_policy(wl, sim, placer)
    measured = placer.ranks[sim.warmup :]
    overflow = sum(1 for rank in measured if rank > 0) / max(1, len(measured))
    left = router.ledger.snapshot("mixed").total
    return replace(result, overflow=overflow, fail_open=router.stats.fail_open, leases_left=left)


def measure_hit_rates(client: redis.Redis, cfg: BenchConfig, wl: Workload) -> HitRateResult:
    sim = cfg.sim_config(wl)
    results = []
    for policy in cfg.policies:
        results.append(run_router_policy(client, policy, cfg, wl, sim))
        progress(f"{policy}: hit ratio {results[-1].hit_ratio:.3f} in {results[-1].wall_s:.1f}s")
    return summarize(wl, sim, cfg.eps, results)


# -- reporting ------------------------------------------------------------------------
def evaluate_targets(latency: Sequence[LatencyResult], hits: HitRateResult) -> list[TargetResult]:
    targets = []
    for r in latency:
        targets += [
            TargetResult(f"route p99 ms ({r.pool})", r.route.p99_ms, TARGET_ROUTE_P99_MS, "<=",
                         r.route.p99_ms <= TARGET_ROUTE_P99_MS,
                         f"PING p99 {r.ping.p99_ms:.3f} ms; route/PING p99 "
                         f"{r.route_vs_ping_p99:.2f}x"),
            TargetResult(f"round trips/route ({r.pool})", r.round_trips_per_route,
                         TARGET_ROUND_TRIPS, "<=", r.round_trips_per_route <= TARGET_ROUND_TRIPS),
        ]  # fmt: skip
    for p in hits.policies:
        if p.policy == "bounded":
            targets.append(
                TargetResult("bounded hit ratio / oracle", p.vs_oracle, TARGET_VS_ORACLE, ">=",
                             p.vs_oracle >= TARGET_VS_ORACLE,
                             f"oracle held to the same bound: {hits.oracle_bounded.vs_oracle:.3f}")
            )  # fmt: skip
    return targets


def progress(message: str) -> None:
    print(f"[router_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def format_latency(report: BenchReport) -> list[str]:
    m = report.machine
    rows = [
        f"decision latency, one Router replica, redis-server {m.redis_server} on TCP loopback; "
        f"baseline: PING on the same connection, interleaved; load average "
        f"{m.loadavg_start} -> {m.loadavg_end} on {m.cpu_count} CPUs",
        f"{'pool':<6} {'workers':>7} {'route p50':>9} {'p99':>6} {'release p50':>11} "
        f"{'ping p50':>8} {'p99':>6} {'route/ping p50':>14} {'p99':>6} {'decisions/s':>11} "
        f"{'pings/s':>8} {'RT/route':>8} {'RT/release':>10} {'us/evalsha':>10}  (ms)",
    ]
    for r in report.latency:
        workers = "+".join(str(n) for n in r.workers.values())
        rows.append(
            f"{r.pool:<6} {workers:>7} {r.route.p50_ms:>9.3f} {r.route.p99_ms:>6.3f} "
            f"{r.release.p50_ms:>11.3f} {r.ping.p50_ms:>8.3f} {r.ping.p99_ms:>6.3f} "
            f"{r.route_vs_ping_p50:>13.2f}x {r.route_vs_ping_p99:>5.2f}x "
            f"{r.decisions_per_s:>11.0f} {r.pings_per_s:>8.0f} {r.round_trips_per_route:>8.3f} "
            f"{r.round_trips_per_release:>10.3f} {r.server_usec_per_evalsha:>10.1f}"
        )
    return rows


def format_table(report: BenchReport) -> str:
    rows = [
        *format_latency(report),
        "",
        *hit_rate_rows(report.hit_rate, report.config.workload),
        "",
        "targets:",
    ]
    for t in report.targets:
        verdict = "met" if t.met else "UNMET"
        rows.append(
            f"  {t.name:<27} {t.measured:7.3f} {t.comparison} {t.threshold:<3} {verdict:<5} "
            f"{t.context}".rstrip()
        )
    rows.append(f"wall {report.wall_s:.0f}s; all targets met: {report.targets_met}")
    return "\n".join(rows)


def write_json(report: BenchReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(report), indent=2, default=str) + "\n", encoding="utf-8")


# -- entry point ----------------------------------------------------------------------
def machine_info(client: redis.Redis, loadavg_start: Sequence[float]) -> MachineInfo:
    return MachineInfo(
        cpu_count=os.cpu_count() or 0,
        loadavg_start=[round(x, 2) for x in loadavg_start],
        loadavg_end=[round(x, 2) for x in os.getloadavg()],
        python=platform.python_version(),
        platform=platform.platform(),
        redis_server=str(client.info("server")["redis_version"]),
        redis_py=importlib.metadata.version("redis"),
    )


def _measure(
    server: EmbeddedRedis, cfg: BenchConfig, wl: Workload, load_start: list[float]
) -> tuple[list[LatencyResult], HitRateResult, MachineInfo]:
    client = connect(server.url, timeout_s=5.0)
    counter = RoundTripCounter()
    counter.install(client)
    try:
        latency = []
        for shape in cfg.pools:
            latency.append(measure_latency(client, counter, shape, cfg, wl))
            progress(f"latency {shape}: route p50 {latency[-1].route.p50_ms:.3f} ms")
        hits = measure_hit_rates(client, cfg, wl)
        return latency, hits, machine_info(client, load_start)
    finally:
        client.close()


def run(cfg: BenchConfig) -> BenchReport:
    started, t0 = datetime.now(UTC), time.perf_counter()
    load_start = list(os.getloadavg())
    wl = make_workload(cfg.workload)
    with EmbeddedRedis(tcp=True) as server:
        pid = server.pid or 0
        progress(f"redis-server pid {pid} at {server.url}")
        latency, hits, machine = _measure(server, cfg, wl, load_start)
    targets = evaluate_targets(latency, hits)
    clean = all(p.leases_left == 0 and p.fail_open == 0 for p in hits.policies) and all(
        r.fail_open == 0 for r in latency
    )
    return BenchReport(
        schema=SCHEMA,
        started_at=started.isoformat(),
        finished_at=datetime.now(UTC).isoformat(),
        wall_s=time.perf_counter() - t0,
        redis_pid=pid,
        machine=machine,
        config=cfg,
        latency=latency,
        hit_rate=hits,
        targets=targets,
        targets_met=clean and all(t.met for t in targets),
    )


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


BENCH_FLAGS = ("decisions", "latency_warmup", "latency_inflight", "pools", "workers", "window",
               "warmup_requests", "cache_factor", "eps", "prefix_blocks", "policies",
               "out")  # fmt: skip
WORKLOAD_FLAGS = ("tenants", "prompts_per_tenant", "zipf_s", "system_tokens", "suffix_tokens",
                  "requests", "seed")  # fmt: skip


def _flag_type(default: object) -> Callable[[str], Any]:
    if isinstance(default, tuple) and default and isinstance(default[0], int):
        return lambda text: tuple(int(x) for x in _csv(text))
    return _csv if isinstance(default, tuple) else type(default)


def parse_args(argv: Sequence[str] | None = None) -> BenchConfig:
    """One flag per field named in BENCH_FLAGS / WORKLOAD_FLAGS (`--zipf-s 1.1`); tuples
    are comma-separated (`--policies bounded,random`, `--system-tokens 64,256`)."""
    p = argparse.ArgumentParser(
        prog="python -m loadtest.router_bench",
        description="Router decision latency against Redis PING, and the prefix-hit rate "
        "of each placement policy against a cache-aware oracle.",
    )
    for defaults, names in ((BenchConfig(), BENCH_FLAGS), (WorkloadConfig(), WORKLOAD_FLAGS)):
        for name in names:
            default = getattr(defaults, name)
            p.add_argument("--" + name.replace("_", "-"), dest=name, type=_flag_type(default),
                           default=default, help="default: %(default)s")  # fmt: skip
    a = vars(p.parse_args(argv))
    workload = WorkloadConfig(**{n: a[n] for n in WORKLOAD_FLAGS})
    return BenchConfig(workload=workload, **{n: a[n] for n in BENCH_FLAGS})


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the embedded Redis is stopped on the way out too.
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_exit) if on_main else None
    try:
        report = run(cfg)
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)
    print(format_table(report))
    write_json(report, cfg.out)
    progress(f"wrote {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Placement at scale: N router replicas (one per gateway) placing against one Redis.

Lifecycle, per design and replica count N (`measure_scale`):
1. Workers are registered: 8 mixed ones, in one namespace (design `shared`: pdserve,
   where every replica places through the same load ledger and cache model) or in one
   namespace per replica (`per_replica`: the same router code, but each replica counts
   only its own load and models only its own placements, as routers that keep their
   state per replica do). The second is the baseline, measured in the same run.
2. N processes start (spawn) and wait at a barrier; each builds a `Router` on its own
   connection and places the requests i = r (mod N) of the workload, in order, with a
   sliding window of window/N in flight (so the cluster holds `window`, as the
   single-replica replay does), sending a PING after every decision (the baseline for
   its latency, interleaved). Each logs its placements and releases with
   `time.monotonic_ns()` (one clock for every process on Linux), its decision and PING
   times, its Redis round trips (`RoundTripCounter`, PINGs left out) and, from each
   placement script's own answer, whether the picked worker was under the bound.
3. Meanwhile the parent samples the cluster's true in-flight load per worker from Redis
   (`LoadSampler`): max/avg over all replicas' leases (per replica, each replica's own
   view may look balanced while the sum is not).
4. The parent merges every replica's placements and releases by time and replays them
   through the cache simulation (`ClusterSim`): the hit ratio the cluster got. Every
   lease is released; the pools must be empty.

The host's cores are shared by the replicas, Redis and the parent: decision latency at
8 replicas on a 2-core host measures CPU contention as much as Redis, which is why the
PING beside it is measured the same way.
"""

from __future__ import annotations

import heapq
import multiprocessing as mp
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.synchronize import Barrier

import numpy as np
import redis

from loadtest.router.latency import Percentiles, RoundTripCounter
from loadtest.router.pool import make_router, register_workers
from loadtest.workloads.prefix import ClusterSim, SimConfig, Workload, WorkloadConfig, make_workload
from services.router.keyspace import Keyspace
from services.router.load import LoadLedger
from services.router.placement import RouteQuery
from services.router.redis_client import connect
from services.router.router import Router

DESIGNS = ("shared", "per_replica")
POLICY = "bounded"
#: Seconds a replica process may take to start and reach the barrier.
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ReplicaJob:
    """What one replica process places: everything picklable."""

    url: str
    namespace: str
    replica: int
    replicas: int
    window: int  # this replica's in-flight requests
    workload: WorkloadConfig
    worker_ids: tuple[str, ...]
    eps: float
    prefix_blocks: int


@dataclass
class ReplicaLog:
    """One replica's events and samples (times in `time.monotonic_ns`)."""

    places: list[tuple[int, int, int]] = field(default_factory=list)  # (t, request, worker)
    releases: list[tuple[int, int]] = field(default_factory=list)  # (t, worker)
    route_s: list[float] = field(default_factory=list)
    ping_s: list[float] = field(default_factory=list)
    round_trips: int = 0  # PINGs excluded
    over_bound: int = 0  # placements whose worker was not under the bound, per Redis
    fail_open: int = 0
    error: str = ""


@dataclass(frozen=True)
class ScaleRow:
    design: str
    replicas: int
    decisions: int
    route: Percentiles
    ping: Percentiles
    route_vs_ping_p99: float
    round_trips_per_request: float  # placement and release together, PINGs left out
    decisions_per_s: float  # all replicas together
    over_bound: int  # placements over the load bound as each one's script saw it
    load_max_over_avg_peak: float  # the cluster's true in-flight load (`LoadSampler`)
    load_max_over_avg_mean: float
    load_samples: int
    hit_ratio: float
    fail_open: int
    leases_left: int
    vs_oracle: float = 0.0  # hit_ratio / the unbounded oracle's (filled in by the bench)


def _place_share(job: ReplicaJob, barrier: Barrier, out: mp.Queue) -> None:
    """A replica process's body: see the module docstring, step 2."""
    log = ReplicaLog()
    try:
        wl = make_workload(job.workload)
        client = connect(job.url, timeout_s=5.0)
        counter = RoundTripCounter()
        counter.install(client)
        router = make_router(client, job.namespace, POLICY, eps=job.eps,
                             prefix_blocks=job.prefix_blocks, workload=job.workload)  # fmt: skip
        index = {w: i for i, w in enumerate(job.worker_ids)}
        barrier.wait(START_TIMEOUT_S)
        counter.count = 0  # the membership read of the setup is not a request's
        _run_share(router, wl, job, index, log)
        log.fail_open = router.stats.fail_open
        log.round_trips = counter.count - len(log.ping_s)
    except Exception as exc:  # reported to the parent, which fails the run
        log.error = f"{type(exc).__name__}: {exc}"
        barrier.abort()
    out.put((job.replica, log))


def _run_share(router: Router, wl: Workload, job: ReplicaJob, index: dict[str, int],
               log: ReplicaLog) -> None:  # fmt: skip
    inflight: deque[tuple[int, tuple[str, ...]]] = deque()
    clock = time.perf_counter

    def release_oldest() -> None:
        worker, leases = inflight.popleft()
        router.release(leases)
        log.releases.append((time.monotonic_ns(), worker))

    try:
        for i in range(job.replica, len(wl.requests), job.replicas):
            if len(inflight) >= job.window:
                release_oldest()
            req = wl.requests[i]
            t0 = clock()
            routed = router.route_detailed(RouteQuery(req.request_id, req.tokens, req.tenant))
            t1 = clock()
            router.client.ping()
            t2 = clock()
            worker = index[routed.decision.decode.worker_id]
            log.places.append((time.monotonic_ns(), i, worker))
            log.route_s.append(t1 - t0)
            log.ping_s.append(t2 - t1)
            log.over_bound += sum(1 for p in routed.placements if p.load >= p.bound)
            inflight.append((worker, routed.decision.load_lease_ids))
    finally:
        while inflight:
            release_oldest()


def _run_replicas(jobs: Sequence[ReplicaJob]) -> list[ReplicaLog]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(jobs))
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_place_share, args=(job, barrier, out), daemon=True)
             for job in jobs]  # fmt: skip
    for p in procs:
        p.start()
    try:
        logs = dict(out.get(timeout=START_TIMEOUT_S + 600.0) for _ in jobs)
    finally:
        for p in procs:
            p.join(10.0)
            if p.is_alive():
                p.kill()
    errors = [log.error for log in logs.values() if log.error]
    if errors:
        raise RuntimeError(f"a router replica failed: {errors[0]}")
    return [logs[r] for r in range(len(jobs))]


class LoadSampler:
    """The cluster's true in-flight load per worker, read from Redis every `period_s`:
    one MULTI reads every namespace's count hash at one instant (Redis runs it whole),
    so the sum over per-replica namespaces is as exact as the shared one. Samples with
    fewer than `full` leases in flight (the start and the drain) are left out."""

    def __init__(self, url: str, count_keys: Sequence[str], workers: int, *, full: int,
                 period_s: float = 0.005) -> None:  # fmt: skip
        self.client = connect(url, timeout_s=5.0)
        self.keys = list(count_keys)
        self.workers = workers
        self.full = full
        self.period_s = period_s
        self.samples: list[float] = []  # max / average, per sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            pipe = self.client.pipeline(transaction=True)
            for key in self.keys:
                pipe.hgetall(key)
            loads: dict[str, int] = {}
            for counts in pipe.execute():
                for worker, n in counts.items():
                    loads[worker] = loads.get(worker, 0) + int(n)
            total = sum(loads.values())
            if total >= self.full:
                self.samples.append(max(loads.values()) * self.workers / total)

    def ratios(self) -> tuple[float, float]:
        """(peak, mean) of max/avg over the samples."""
        if not self.samples:
            return 0.0, 0.0
        return max(self.samples), float(np.mean(self.samples))

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()


def replay(wl: Workload, sim_cfg: SimConfig, logs: Sequence[ReplicaLog]) -> float:
    """The hit ratio of the merged placements, after `sim_cfg.warmup` of them."""
    sim = ClusterSim(sim_cfg)
    events = heapq.merge(
        *([(t, 1, 0, w) for t, w in log.releases] for log in logs),
        *([(t, 0, i, w) for t, i, w in log.places] for log in logs),
    )
    placed = hit_tokens = prompt_tokens = 0
    for _, is_release, i, worker in events:
        if is_release:
            sim.release(worker)
            continue
        request = wl.requests[i]
        hit = sim.place(worker, request)
        placed += 1
        if placed > sim_cfg.warmup:
            hit_tokens += hit * wl.config.block_size
            prompt_tokens += len(request.tokens)
    return hit_tokens / max(1, prompt_tokens)


def measure_design(
    url: str, wl: Workload, sim_cfg: SimConfig, design: str, replicas: int, *, eps: float,
    prefix_blocks: int,
) -> ScaleRow:  # fmt: skip
    """One design at one replica count (see the module docstring)."""
    client = connect(url, timeout_s=5.0)
    base = f"bench-scale-{design}-{replicas}-{uuid.uuid4().hex[:8]}"
    namespaces = [base if design == "shared" else f"{base}-r{r}" for r in range(replicas)]
    for ns in dict.fromkeys(namespaces):
        ids = register_workers(client, ns, ("mixed",), sim_cfg.workers, wl.config.model,
                               sim_cfg.capacity_blocks)  # fmt: skip
    window = max(1, sim_cfg.window // replicas)
    jobs = [ReplicaJob(url, namespaces[r], r, replicas, window, wl.config, tuple(ids), eps,
                       prefix_blocks) for r in range(replicas)]  # fmt: skip
    sampler = LoadSampler(url, [Keyspace(ns).count("mixed") for ns in dict.fromkeys(namespaces)],
                          sim_cfg.workers, full=sim_cfg.window - replicas)  # fmt: skip
    t0 = time.perf_counter()
    with sampler:
        logs = _run_replicas(jobs)
    wall = time.perf_counter() - t0
    hit = replay(wl, sim_cfg, logs)
    peak, mean = sampler.ratios()
    left = sum(_leases_left(client, ns) for ns in dict.fromkeys(namespaces))
    route = Percentiles.of([s for log in logs for s in log.route_s])
    ping = Percentiles.of([s for log in logs for s in log.ping_s])
    decisions = sum(len(log.route_s) for log in logs)
    client.close()
    return ScaleRow(
        design=design, replicas=replicas, decisions=decisions, route=route, ping=ping,
        route_vs_ping_p99=route.p99_ms / ping.p99_ms,
        round_trips_per_request=sum(log.round_trips for log in logs) / max(1, decisions),
        decisions_per_s=decisions / wall, over_bound=sum(log.over_bound for log in logs),
        load_max_over_avg_peak=peak, load_max_over_avg_mean=mean,
        load_samples=len(sampler.samples), hit_ratio=hit,
        fail_open=sum(log.fail_open for log in logs), leases_left=left,
    )  # fmt: skip


def _leases_left(client: redis.Redis, namespace: str) -> int:
    return LoadLedger(client, Keyspace(namespace)).snapshot("mixed").total


def measure_scale(
    url: str, wl: Workload, sim_cfg: SimConfig, counts: Sequence[int], *, eps: float,
    prefix_blocks: int, progress: Callable[[str], None],
) -> list[ScaleRow]:  # fmt: skip
    rows = []
    for replicas in counts:
        for design in DESIGNS:
            if design == "per_replica" and replicas == 1:
                continue  # one replica: the same thing as shared
            row = measure_design(url, wl, sim_cfg, design, replicas, eps=eps,
                                 prefix_blocks=prefix_blocks)  # fmt: skip
            progress(
                f"{design} x{replicas}: hit {row.hit_ratio:.3f}, load max/avg peak "
                f"{row.load_max_over_avg_peak:.2f}, route p99 {row.route.p99_ms:.2f} ms"
            )
            rows.append(row)
    return rows

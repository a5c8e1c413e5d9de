"""Placement by the caches the workers report, against the router's own cache model,
under eviction and restarts, in one run.

Lifecycle (`measure_residency`): the hit-rate step's workload and simulated caches
(each worker an LRU pool of `capacity_blocks`, smaller than the hot set: evictions all
the time) are replayed three times, each in a fresh namespace of 8 mixed workers:

- `reported`: the real `Router` (policy bounded) with the workers reporting: every
  `report_every` placements each worker's changes since its last report are applied to
  its set through `ResidencyBoard`, as a worker's feed does once per signal interval;
- `modelled`: the same router with `match_blocks` 0, which ignores reports and places
  by its model of each cache (what every release before the worker-fed index did);
- `oracle`: the greedy placement that reads the true caches, held to the same load
  bound: the hit ratio reachable with the true residency.

In each, `restarts` workers restart during the measured part (spread evenly, each a
different worker): its simulated cache empties and it registers a new incarnation, as
a restarted process does; a reporting one then resets its set. The router's model is
left as a real router's would be: it still believes what it placed there.

Reported: each replay's hit ratio (hit tokens / prompt tokens, from the simulated
caches), the two routers' ratios to the oracle and to each other, and the reporting
router's own count of the leading blocks its picks held against the most any
candidate held. Every lease is released (`leases_left` must be 0).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

import redis

from loadtest.router.hit_rate import RouterPlacer
from loadtest.router.pool import LAYOUT, REGISTRATION_TTL_S, make_router, register_workers
from loadtest.workloads.prefix import (
    ClusterSim,
    OraclePlacer,
    Placer,
    PolicyResult,
    PrefixCache,
    SimConfig,
    Workload,
    run_policy,
)
from services.common.role import Role
from services.router.keyspace import Keyspace
from services.router.registry import Registry, WorkerInfo
from services.router.residency import ResidencyBoard

#: How long a reported set lives without a report: longer than any replay.
REPORT_TTL_S = 3600.0


@dataclass(frozen=True)
class ResidencyResult:
    reported: PolicyResult
    modelled: PolicyResult
    oracle: PolicyResult
    restarts: int
    report_every: int
    reported_vs_modelled: float  # hit ratio, reported / modelled
    reported_vs_oracle: float
    modelled_vs_oracle: float
    run_blocks: int  # leading blocks the reporting router's picks held (its own count)
    best_run_blocks: int  # the most any candidate held, load bound aside


class _Workers:
    """The replay's side of the workers: their registrations and, when they report,
    their sets; `before` is the replay's hook (`run_policy`)."""

    def __init__(
        self,
        client: redis.Redis,
        namespace: str,
        ids: list[str],
        sim: SimConfig,
        wl: Workload,
        *,
        reporting: bool,
        restart_at: dict[int, int],
        report_every: int,
    ) -> None:
        keys = Keyspace(namespace)
        self.registry = Registry(client, keys, ttl_s=REGISTRATION_TTL_S)
        self.board = ResidencyBoard(client, keys, REPORT_TTL_S)
        self.ids, self.sim_cfg, self.model = ids, sim, wl.config.model
        self.reporting, self.restart_at, self.report_every = reporting, restart_at, report_every
        self.incarnation = {w: 0 for w in ids}
        self.reported: dict[str, frozenset[int]] = {}
        for worker_id in ids:
            self._register(worker_id)

    def before(self, i: int, sim: ClusterSim) -> None:
        victim = self.restart_at.get(i)
        if victim is not None:
            self._restart(victim, sim)
        if self.reporting and i % self.report_every == 0:
            for w, worker_id in enumerate(self.ids):
                self._report(worker_id, sim.caches[w].blocks())

    def _restart(self, w: int, sim: ClusterSim) -> None:
        worker_id = self.ids[w]
        sim.caches[w] = PrefixCache(self.sim_cfg.capacity_blocks, self.sim_cfg.tier_blocks)
        self.incarnation[worker_id] += 1
        self._register(worker_id)
        self.reported.pop(worker_id, None)  # the new process starts with a snapshot

    def _register(self, worker_id: str) -> None:
        self.registry.register(
            WorkerInfo(worker_id, Role.MIXED, self.model, LAYOUT, f"{worker_id}.invalid:0",
                       self.sim_cfg.capacity_blocks, incarnation=str(self.incarnation[worker_id]))
        )  # fmt: skip

    def _report(self, worker_id: str, now: frozenset[int]) -> None:
        incarnation = str(self.incarnation[worker_id])
        last = self.reported.get(worker_id)
        if last is None or not self.board.apply(worker_id, incarnation, now - last, last - now):
            self.board.reset(worker_id, incarnation, now)
        self.reported[worker_id] = now


def _restart_points(sim: SimConfig, requests: int, restarts: int) -> dict[int, int]:
    """Request index -> worker restarting there: spread over the measured requests."""
    span = requests - sim.warmup
    return {sim.warmup + (k + 1) * span // (restarts + 1): k % sim.workers for k in range(restarts)}


def _replay(
    client: redis.Redis,
    wl: Workload,
    sim: SimConfig,
    name: str,
    make_placer: Callable[[str, list[str]], Placer],
    *,
    reporting: bool,
    restart_at: dict[int, int],
    report_every: int,
) -> tuple[PolicyResult, Placer]:
    namespace = f"bench-residency-{name}-{uuid.uuid4().hex[:8]}"
    ids = register_workers(client, namespace, ("mixed",), sim.workers, wl.config.model,
                           sim.capacity_blocks)  # fmt: skip
    workers = _Workers(client, namespace, ids, sim, wl, reporting=reporting,
                       restart_at=restart_at, report_every=report_every)  # fmt: skip
    placer = make_placer(namespace, ids)
    result = replace(run_policy(wl, sim, placer, workers.before), policy=name)
    return result, placer


def measure_residency(
    client: redis.Redis,
    wl: Workload,
    sim: SimConfig,
    *,
    eps: float,
    prefix_blocks: int,
    restarts: int,
    report_every: int,
    progress: Callable[[str], None],
) -> ResidencyResult:
    restart_at = _restart_points(sim, len(wl.requests), restarts)

    def router(match_blocks: int) -> Callable[[str, list[str]], Placer]:
        def build(namespace: str, ids: list[str]) -> Placer:
            r = make_router(client, namespace, "bounded", eps=eps, prefix_blocks=prefix_blocks,
                            workload=wl.config, match_blocks=match_blocks)  # fmt: skip
            return RouterPlacer(r, ids)

        return build

    runs: dict[str, PolicyResult] = {}
    placers: dict[str, Placer] = {}
    plans = (("reported", router(32), True), ("modelled", router(0), False),
             ("oracle", lambda _ns, _ids: OraclePlacer(eps), False))  # fmt: skip
    for name, make_placer, reporting in plans:
        result, placer = _replay(client, wl, sim, name, make_placer, reporting=reporting,
                                 restart_at=restart_at, report_every=report_every)  # fmt: skip
        if isinstance(placer, RouterPlacer):
            left = placer.router.ledger.snapshot("mixed").total
            result = replace(result, fail_open=placer.router.stats.fail_open, leases_left=left)
        runs[name], placers[name] = result, placer
        progress(f"residency {name}: hit ratio {result.hit_ratio:.3f}")
    reported_router = placers["reported"]
    assert isinstance(reported_router, RouterPlacer)
    stats = reported_router.router.stats
    oracle = max(runs["oracle"].hit_ratio, 1e-12)
    return ResidencyResult(
        reported=runs["reported"], modelled=runs["modelled"], oracle=runs["oracle"],
        restarts=restarts, report_every=report_every,
        reported_vs_modelled=runs["reported"].hit_ratio / max(runs["modelled"].hit_ratio, 1e-12),
        reported_vs_oracle=runs["reported"].hit_ratio / oracle,
        modelled_vs_oracle=runs["modelled"].hit_ratio / oracle,
        run_blocks=stats.prefix_runs, best_run_blocks=stats.prefix_best_runs,
    )  # fmt: skip

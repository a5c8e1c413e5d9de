"""Prefix-hit rate of each placement policy through the real Router, against the oracles.

Lifecycle, per policy (`measure_hit_rates`): 8 mixed workers are registered in a fresh
namespace and a fresh `Router` replica places the whole request sequence with a sliding
window of in-flight requests (`workloads.prefix.run_policy`), each worker's prefix cache
simulated. Every lease is released by the replay; the pool's load ledger must then be
empty (`leases_left`). `workloads.prefix.summarize` adds the oracles and the upper bound
computed on the same sequence and caches.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace

import redis

from loadtest.router.pool import make_router, register_workers
from loadtest.workloads.prefix import (
    ChatRequest,
    ClusterSim,
    HitRateResult,
    PolicyResult,
    SimConfig,
    Workload,
    run_policy,
    summarize,
)
from services.router.placement import RouteQuery
from services.router.router import Router

#: The offload tier per worker, as a multiple of its cache (issue 21: "a tier 4x the pool").
TIER_FACTOR = 4


class RouterPlacer:
    """`Placer` over the real router; worker ids map to the simulation's indices."""

    def __init__(self, router: Router, worker_ids: Sequence[str]) -> None:
        self.router = router
        self.name = router.config.policy
        self.index = {w: i for i, w in enumerate(worker_ids)}
        self.ranks: list[int] = []  # per decision: index of the pick in the policy's order

    def place(self, request: ChatRequest, sim: ClusterSim) -> tuple[int, tuple[str, ...]]:
        routed = self.router.route_detailed(
            RouteQuery(request.request_id, request.tokens, request.tenant)
        )
        self.ranks.append(max(p.rank for p in routed.placements))
        return self.index[routed.decision.decode.worker_id], routed.decision.load_lease_ids

    def release(self, leases: tuple[str, ...]) -> None:
        self.router.release(leases)


def run_router_policy(
    client: redis.Redis,
    policy: str,
    wl: Workload,
    sim: SimConfig,
    *,
    eps: float,
    prefix_blocks: int,
) -> PolicyResult:
    """Replay the workload through a fresh router and pool; every lease must be released."""
    namespace = f"bench-hit-{policy}-{uuid.uuid4().hex[:8]}"
    ids = register_workers(client, namespace, ("mixed",), sim.workers, wl.config.model,
                           sim.capacity_blocks)  # fmt: skip
    router = make_router(client, namespace, policy, eps=eps, prefix_blocks=prefix_blocks,
                         workload=wl.config)  # fmt: skip
    placer = RouterPlacer(router, ids)
    result = run_policy(wl, sim, placer)
    measured = placer.ranks[sim.warmup :]
    overflow = sum(1 for rank in measured if rank > 0) / max(1, len(measured))
    left = router.ledger.snapshot("mixed").total
    return replace(result, overflow=overflow, fail_open=router.stats.fail_open, leases_left=left)


def measure_hit_rates(
    client: redis.Redis,
    wl: Workload,
    sim: SimConfig,
    policies: Sequence[str],
    *,
    eps: float,
    prefix_blocks: int,
    progress: Callable[[str], None],
) -> HitRateResult:
    results = []
    for policy in policies:
        result = run_router_policy(client, policy, wl, sim, eps=eps, prefix_blocks=prefix_blocks)
        progress(f"{policy}: hit ratio {result.hit_ratio:.3f} in {result.wall_s:.1f}s")
        results.append(result)
    tier = TIER_FACTOR * sim.capacity_blocks
    tiered = run_router_policy(client, policies[0], wl, replace(sim, tier_blocks=tier), eps=eps,
                               prefix_blocks=prefix_blocks)  # fmt: skip
    tiered = replace(tiered, policy=f"{policies[0]}+tier")
    progress(f"{tiered.policy}: hit ratio {tiered.hit_ratio:.3f} with a {tier}-block tier")
    return summarize(wl, sim, eps, results, (tier, tiered))

"""The router benchmark's worker pools: registrations in a namespace, and a Router on them.

Lifecycle: each measurement (a latency pool shape, a hit-rate policy) takes a fresh
namespace, so no lease, load count or cache model carries over from the one before;
`register_workers` writes the registrations (no heartbeat runs: their TTL outlives the
run) and `make_router` builds one `Router` replica over them and reads the membership
once. Nothing here releases anything: the measurements release every lease they take.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from loadtest.workloads.prefix import WorkloadConfig
from services.common.role import Role
from services.router.keyspace import Keyspace
from services.router.registry import Registry, WorkerInfo
from services.router.router import Router
from services.router.router_config import RouterConfig

LAYOUT = "bench-layout"
#: Pool shapes of the latency measurement: the roles each decision places in.
POOL_SHAPES: dict[str, tuple[str, ...]] = {"mixed": ("mixed",), "pd": ("prefill", "decode")}
#: Registrations outlive the run: no heartbeat task runs here.
REGISTRATION_TTL_S = 3600.0


def register_workers(
    client: redis.Redis, namespace: str, roles: Sequence[str], n: int, model: str, capacity: int
) -> list[str]:
    """Register n workers per role; returns their ids in registration order."""
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


def make_router(
    client: redis.Redis,
    namespace: str,
    policy: str,
    *,
    eps: float,
    prefix_blocks: int,
    workload: WorkloadConfig,
    match_blocks: int = RouterConfig.match_blocks,
) -> Router:
    """A Router replica on the namespace; raises if Redis does not answer."""
    config = RouterConfig(
        namespace=namespace, policy=policy, eps=eps, prefix_blocks=prefix_blocks,
        block_size=workload.block_size, model_fingerprint=workload.model, seed=workload.seed,
        match_blocks=match_blocks,
    )  # fmt: skip
    router = Router(client, config)
    if not router.refresh():
        raise RuntimeError("the benchmark's Redis is unreachable")
    return router

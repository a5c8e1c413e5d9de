"""Router decision latency against Redis PING on the same connection.

Lifecycle of one pool shape (`measure_latency`): workers are registered in a fresh
namespace and one `Router` replica runs `latency_warmup` unmeasured cycles, then
`decisions` measured ones. A cycle releases the oldest held decision once `inflight`
are held, routes the next request, then sends a PING: the baseline, interleaved so that
the shared machine's noise hits router and Redis alike. Every decision is released
before it returns. Round trips are counted client side by `RoundTripCounter` (one per
command or pipeline written); `INFO commandstats` deltas say what the server ran.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis

from loadtest.router.pool import POOL_SHAPES, make_router, register_workers
from loadtest.workloads.prefix import ChatRequest, Workload
from services.router.placement import RouteQuery
from services.router.router import Router


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
class LatencyPlan:
    """What `measure_latency` runs: the config's latency knobs, for one pool shape."""

    decisions: int
    warmup: int
    inflight: int
    workers: int
    eps: float
    prefix_blocks: int


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
            decision = router.route(RouteQuery(req.request_id, req.tokens, req.tenant))
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
    client: redis.Redis, counter: RoundTripCounter, shape: str, plan: LatencyPlan, wl: Workload
) -> LatencyResult:
    roles = POOL_SHAPES[shape]
    namespace = f"bench-latency-{shape}-{uuid.uuid4().hex[:8]}"
    register_workers(client, namespace, roles, plan.workers, wl.config.model, 0)
    router = make_router(client, namespace, "bounded", eps=plan.eps,
                         prefix_blocks=plan.prefix_blocks, workload=wl.config)  # fmt: skip
    total = plan.warmup + plan.decisions
    requests = [wl.requests[i % len(wl.requests)] for i in range(total)]
    _cycles(router, counter, requests[: plan.warmup], plan.inflight, total)
    before = command_calls(client)
    s = _cycles(router, counter, requests[plan.warmup :], plan.inflight, 0)
    after = command_calls(client)
    deltas = {k: v[0] - before.get(k, (0, 0))[0] for k, v in after.items() if k != "info"}
    evalsha_usec = after.get("evalsha", (0, 0))[1] - before.get("evalsha", (0, 0))[1]
    route, release, ping = (Percentiles.of(x) for x in (s.route, s.release, s.ping))
    return LatencyResult(
        pool=shape,
        workers={r: plan.workers for r in roles},
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

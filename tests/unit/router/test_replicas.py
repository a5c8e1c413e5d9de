"""Three router replicas, each with its own Redis client, sharing one Redis."""

from __future__ import annotations

import collections
import math
import random
import threading
from collections.abc import Callable

import redis

from services.router.embedded_redis import EmbeddedRedis
from services.router.load import LoadSnapshot
from services.router.placement import RouteQuery
from services.router.redis_client import connect
from services.router.router import Routed, Router
from services.router.router_config import RouterConfig
from tests.unit.router.conftest import age_leases, lease_expiries, register_pool

EPS = 0.25
N_WORKERS = 4


def prompt(rng: random.Random) -> list[int]:
    # Half the traffic shares one system prompt: without the bound one worker gets it all.
    head = 0 if rng.random() < 0.5 else rng.randrange(1, 300)
    return [head] * 64 + [rng.randrange(1000) for _ in range(8)]


def check(routed: Routed) -> None:
    for p in routed.placements:
        assert not p.local
        assert p.load < p.bound == math.ceil((1 + EPS) * (p.total + 1) / p.n), p


def run_replicas(
    url: str,
    namespace: str,
    counts: list[int],
    release_p: float,
    ttl_s: float = 60.0,
    abandon: Callable[[int], bool] = lambda i: False,
) -> list[list[str]]:
    """Each replica routes counts[i] requests, releasing at random; returns the lease ids
    each still holds at the end."""
    held: list[list[tuple[str, ...]]] = [[] for _ in counts]
    errors: list[BaseException] = []
    start = threading.Barrier(len(counts))

    def replica(i: int) -> None:
        client = connect(url, timeout_s=5.0)
        cfg = RouterConfig(namespace=namespace, eps=EPS, load_ttl_s=ttl_s)
        router = Router(client, cfg)
        rng = random.Random(i)
        try:
            start.wait()
            for n in range(counts[i]):
                routed = router.route_detailed(
                    RouteQuery(f"{i}-{n}", prompt(rng), f"tenant{n % 3}")
                )
                check(routed)
                held[i].append(routed.decision.load_lease_ids)
                if rng.random() < release_p and not abandon(i):
                    router.release(held[i].pop(rng.randrange(len(held[i]))))
                if abandon(i) and n == counts[i] // 2:
                    return  # "killed": its leases are never released
            assert router.stats.fail_open == 0
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(len(counts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return [[lease for leases in h for lease in leases] for h in held]


def snapshots(client: redis.Redis, namespace: str) -> dict[str, LoadSnapshot]:
    router = Router(client, RouterConfig(namespace=namespace))
    return {role: router.ledger.snapshot(role) for role in ("prefill", "decode")}


def release_all(client: redis.Redis, namespace: str, held: list[list[str]]) -> None:
    router = Router(client, RouterConfig(namespace=namespace))
    for leases in held:
        router.release(leases)


def test_three_replicas_10k_requests_never_break_the_bound(
    redis_server: EmbeddedRedis, client: redis.Redis, namespace: str
) -> None:
    register_pool(client, namespace, "prefill", N_WORKERS)
    register_pool(client, namespace, "decode", N_WORKERS)
    # Phase 1, no releases: the final Redis state itself must satisfy the bound.
    held = run_replicas(redis_server.url, namespace, [1500] * 3, release_p=0.0)
    for snap in snapshots(client, namespace).values():
        assert snap.total == snap.leases == 4500
        assert max(snap.counts.values()) <= math.ceil((1 + EPS) * snap.total / N_WORKERS)
    # Phase 2: concurrent routes and releases; every decision checked as it was made.
    more = run_replicas(redis_server.url, namespace, [1834, 1833, 1833], release_p=0.6)
    held = [a + b for a, b in zip(held, more, strict=True)]
    for snap in snapshots(client, namespace).values():
        assert snap.total == snap.leases == sum(len(h) for h in held) // 2
    release_all(client, namespace, held)
    for snap in snapshots(client, namespace).values():
        assert (snap.total, snap.leases, snap.counts) == (0, 0, {})


def test_killed_replica_leaks_nothing_after_the_lease_ttl(
    redis_server: EmbeddedRedis, client: redis.Redis, namespace: str
) -> None:
    register_pool(client, namespace, "prefill", N_WORKERS)
    register_pool(client, namespace, "decode", N_WORKERS)
    ttl_s = 60.0  # far longer than the run: no lease may expire before it is aged below
    before_ms = redis_ms(client)
    held = run_replicas(
        redis_server.url, namespace, [300] * 3, release_p=0.5, ttl_s=ttl_s, abandon=lambda i: i == 2
    )
    after_ms = redis_ms(client)
    release_all(client, namespace, held[:2])  # the survivors release everything they hold
    leaked = collections.Counter(lease.split(":", 1)[0] for lease in held[2])
    for role, snap in snapshots(client, namespace).items():
        assert snap.total == leaked[role] > 0  # the dead replica's load is still there ...
        assert snap.expired == 0
        # ... each lease due one load TTL after it was placed (Redis server time) ...
        for expiry in lease_expiries(client, namespace, role).values():
            assert before_ms + ttl_s * 1000 <= expiry <= after_ms + ttl_s * 1000
    for role in leaked:  # ... so once the TTL has passed,
        assert age_leases(client, namespace, role, ttl_s) == leaked[role]
    for role, snap in snapshots(client, namespace).items():
        assert (snap.total, snap.leases, snap.counts) == (0, 0, {})  # it is all purged
        assert snap.expired == leaked[role]  # and counted as expired, not released


def redis_ms(client: redis.Redis) -> int:
    """Redis server time in ms: the clock the lease scripts use."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000

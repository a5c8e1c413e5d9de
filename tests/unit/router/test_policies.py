"""Every policy through the full router against real Redis, leasing load uniformly."""

from __future__ import annotations

import collections

import pytest
import redis

from services.router.placement import RouteQuery
from services.router.prefix_key import prefix_key, tenant_seed
from services.router.router import Router
from services.router.router_config import POLICIES, RouterConfig
from tests.unit.router.conftest import MODEL, register_pool

HOT = list(range(64))  # one shared prefix of four full blocks


def router(client: redis.Redis, namespace: str, policy: str, n: int = 4) -> Router:
    register_pool(client, namespace, "mixed", n)
    r = Router(client, RouterConfig(namespace=namespace, policy=policy, seed=1))
    r.refresh()
    return r


def route_hot(r: Router, count: int) -> list[str]:
    return [r.route(RouteQuery(str(i), HOT, "t")).decode.worker_id for i in range(count)]


@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_routes_and_leases_load(
    client: redis.Redis, namespace: str, policy: str
) -> None:
    r = router(client, namespace, policy)
    decisions = [r.route(RouteQuery(str(i), [i % 7] * 40, f"tenant{i % 3}")) for i in range(40)]
    snap = r.ledger.snapshot("mixed")
    assert snap.total == 40 and snap.leases == 40
    assert all(d.prefill is None and d.decode.role == "mixed" for d in decisions)
    for d in decisions:
        r.release(d.load_lease_ids)
    assert r.ledger.snapshot("mixed").counts == {}


def test_consistent_sends_a_hot_key_to_one_worker(client: redis.Redis, namespace: str) -> None:
    assert len(set(route_hot(router(client, namespace, "consistent"), 30))) == 1


def test_bounded_spills_a_hot_key_but_keeps_affinity(client: redis.Redis, namespace: str) -> None:
    r = router(client, namespace, "bounded")
    placed = collections.Counter(route_hot(r, 40))
    key = prefix_key(HOT, 16, 4, tenant_seed(MODEL, "t"))
    walk = list(r.membership.view().ring("mixed").walk(key))
    # Loads fill up in ring order from the key; nobody goes over ceil(1.25 * 40 / 4) = 13.
    assert placed[walk[0]] == max(placed.values()) <= 13
    assert placed[walk[0]] >= placed[walk[1]] >= placed[walk[2]]
    assert r.stats.overflow == 40 - placed[walk[0]]


def test_round_robin_cycles_through_workers(client: redis.Redis, namespace: str) -> None:
    placed = route_hot(router(client, namespace, "round_robin"), 8)
    assert placed == ["m0", "m1", "m2", "m3"] * 2


def test_least_loaded_evens_out_exactly(client: redis.Redis, namespace: str) -> None:
    placed = collections.Counter(route_hot(router(client, namespace, "least_loaded"), 40))
    assert sorted(placed.values()) == [10, 10, 10, 10]


def test_random_spreads_a_hot_key(client: redis.Redis, namespace: str) -> None:
    placed = collections.Counter(route_hot(router(client, namespace, "random"), 80))
    assert len(placed) == 4

"""A worker's standing in the placement script, on real Redis: the shared breaker (a worker
reported down gets no placements from any router until its mark runs out or it restarts)
and slow start (a worker that joins warmer ones takes a share of the bound that ramps)."""

from __future__ import annotations

from collections import Counter

import redis

from services.router.keyspace import Keyspace
from services.router.placement import RouteQuery
from services.router.registry import Registry
from services.router.router import Router
from services.router.router_config import RouterConfig
from tests.unit.router.conftest import register_pool, worker


def _router(client: redis.Redis, namespace: str, **kw: object) -> Router:
    r = Router(client, RouterConfig(namespace=namespace, policy="bounded_ring", **kw))  # type: ignore[arg-type]
    r.refresh()
    return r


def _server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _set_field(client: redis.Redis, namespace: str, worker_id: str, **fields: int) -> None:
    """The test's clock: the script reads Redis's TIME, so ages are set, not waited for."""
    client.hset(Keyspace(namespace).worker(worker_id), mapping=fields)


def _placed(r: Router, n: int, tag: str) -> Counter[str]:
    """Where n requests with distinct prefixes went (their load kept: nothing released)."""
    return Counter(
        r.route(RouteQuery(f"{tag}{i}", [i, i + 1] * 40, "t")).decode.worker_id for i in range(n)
    )


def test_a_worker_reported_down_is_skipped_by_every_router_at_once(
    client: redis.Redis, namespace: str
) -> None:
    register_pool(client, namespace, "mixed", 3)
    a, b = _router(client, namespace), _router(client, namespace, membership_refresh_s=60)
    a.report_down("m0")
    assert a.stats.marked_down == 1
    assert "m0" not in _placed(b, 30, "b")  # b's view is a minute old: the script decides
    # The mark runs out (aged here): m0 is placed on again.
    _set_field(client, namespace, "m0", down_until=_server_ms(client) - 1)
    assert "m0" in _placed(b, 30, "c")


def test_a_restart_lifts_the_mark_and_all_marked_still_places(
    client: redis.Redis, namespace: str
) -> None:
    register_pool(client, namespace, "mixed", 2)
    r = _router(client, namespace)
    for w in ("m0", "m1"):
        r.report_down(w)
    # Every live worker marked down: trying one beats placing nowhere.
    assert sum(_placed(r, 4, "all").values()) == 4
    registry = Registry(client, Keyspace(namespace))
    registry.register(worker("m0", incarnation="second-start"))
    assert set(_placed(r, 10, "after")) == {"m0"}  # m1 is still marked
    assert not registry.mark_down("never-registered", 5.0)


def test_a_worker_that_joins_warm_ones_ramps_its_share(client: redis.Redis, namespace: str) -> None:
    register_pool(client, namespace, "mixed", 3)
    r = _router(client, namespace, slow_start_s=30.0)
    now = _server_ms(client)
    for w in ("m0", "m1"):
        _set_field(client, namespace, w, joined=now - 60_000)  # warm for a minute
    fresh = _placed(r, 30, "fresh")
    # m2 joined just now: it takes only what the warm two cannot hold under the bound
    # (ceil(1.25 x 30 / 3) = 13 each), not the third it would get as their equal.
    assert fresh["m2"] <= 4 and min(fresh["m0"], fresh["m1"]) >= 12
    # Half-way through its ramp it takes about half a share.
    _set_field(client, namespace, "m2", joined=_server_ms(client) - 15_000)
    half = _placed(r, 30, "half")
    assert 5 <= half["m2"] < min(half["m0"], half["m1"])


def test_workers_that_join_together_share_alike(client: redis.Redis, namespace: str) -> None:
    """A fresh cluster has nobody warmer to defer to: no ramp, the plain bound."""
    register_pool(client, namespace, "mixed", 3)
    r = _router(client, namespace, slow_start_s=30.0)
    placed = _placed(r, 30, "new")
    assert set(placed) == {"m0", "m1", "m2"} and max(placed.values()) <= 13

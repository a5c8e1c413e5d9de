"""Placing the decode side alone (`route_decode`), for a request whose decode worker
refused it after prefill: only the decode pool is placed and leased, the decision names
the prefill worker it was given, and its leases split by side so that the refused decode
worker's alone can be given back. The static placement does the same round-robin."""

from __future__ import annotations

import asyncio

import pytest
import redis

from services.router.placement import (
    NoWorkerError,
    RouteDecision,
    RouteQuery,
    StaticPlacement,
    WorkerRef,
)
from services.router.redis_placement import RedisPlacement
from services.router.router import Router
from services.router.router_config import RouterConfig
from tests.unit.router.conftest import register_pool

PROMPT = list(range(70))


def make_router(client: redis.Redis, namespace: str) -> Router:
    r = Router(client, RouterConfig(namespace=namespace))
    r.refresh()
    return r


def counts(r: Router) -> dict[str, dict[str, int]]:
    return {role: r.ledger.snapshot(role).counts for role in ("prefill", "decode")}


def test_route_decode_places_and_leases_the_decode_pool_alone(
    client: redis.Redis, namespace: str
) -> None:
    register_pool(client, namespace, "prefill", 1)
    register_pool(client, namespace, "decode", 2)
    r = make_router(client, namespace)
    first = r.route(RouteQuery("r1", PROMPT, "t"))
    assert first.prefill is not None
    assert len(first.prefill_lease_ids) == len(first.decode_lease_ids) == 1
    assert first.load_lease_ids == first.prefill_lease_ids + first.decode_lease_ids

    again = r.route_decode(
        RouteQuery("r1", PROMPT, "t", [first.decode.worker_id], prefill=first.prefill)
    )
    assert again.prefill == first.prefill  # named, not placed: no load taken there
    assert again.decode.worker_id != first.decode.worker_id
    assert again.prefill_lease_ids == () and len(again.decode_lease_ids) == 1
    assert counts(r) == {
        "prefill": {first.prefill.worker_id: 1},
        "decode": {first.decode.worker_id: 1, again.decode.worker_id: 1},
    }
    # What a decode re-route gives back: the refused worker's lease, not the prefill one.
    r.release(first.decode_load().load_lease_ids)
    assert counts(r) == {
        "prefill": {first.prefill.worker_id: 1},
        "decode": {again.decode.worker_id: 1},
    }
    r.release(first.prefill_load().load_lease_ids)
    r.release(again.load_lease_ids)
    assert counts(r) == {"prefill": {}, "decode": {}}


def test_route_decode_with_every_decode_worker_excluded(
    client: redis.Redis, namespace: str
) -> None:
    register_pool(client, namespace, "prefill", 1)
    register_pool(client, namespace, "decode", 1)
    r = make_router(client, namespace)
    with pytest.raises(NoWorkerError):
        r.route_decode(RouteQuery("r1", PROMPT, "t", ["d0"]))
    assert counts(r) == {"prefill": {}, "decode": {}}  # nothing leased on the way


def test_route_decode_on_a_mixed_pool(client: redis.Redis, namespace: str) -> None:
    register_pool(client, namespace, "mixed", 2)
    r = make_router(client, namespace)
    first = r.route(RouteQuery("r1", PROMPT, "t"))
    assert first.prefill is None and first.prefill_lease_ids == ()
    again = r.route_decode(RouteQuery("r1", PROMPT, "t", [first.decode.worker_id]))
    assert again.prefill is None and again.decode.worker_id != first.decode.worker_id
    r.release(first.load_lease_ids)
    r.release(again.load_lease_ids)
    assert r.ledger.snapshot("mixed").counts == {}


def test_redis_placement_route_decode(client: redis.Redis, namespace: str) -> None:
    register_pool(client, namespace, "prefill", 1)
    register_pool(client, namespace, "decode", 2)
    r = make_router(client, namespace)
    placement = RedisPlacement(r)

    async def scenario() -> RouteDecision:
        prefill = WorkerRef("p0", "addr-p0", "prefill")
        decision = await placement.route_decode(
            RouteQuery("r1", PROMPT, "t", ["d0"], prefill=prefill)
        )
        assert decision.prefill == prefill and decision.decode.worker_id == "d1"
        await placement.release(decision)
        return decision

    asyncio.run(scenario())
    assert counts(r) == {"prefill": {}, "decode": {}}


def test_static_route_decode_round_robins_the_decode_list() -> None:
    placement = StaticPlacement.from_addresses(["p=h:1"], ["a=h:2", "b=h:3"])
    prefill = WorkerRef("p", "h:1", "prefill")

    async def scenario() -> None:
        first = await placement.route(RouteQuery("r", [1], "t"))
        assert first.decode.worker_id == "a"
        again = await placement.route_decode(RouteQuery("r", [1], "t", ["a"], prefill=prefill))
        assert again == RouteDecision(prefill, WorkerRef("b", "h:3", "decode"))
        assert (
            await placement.route_decode(RouteQuery("r", [1], "t", ["b"]))
        ).decode.worker_id == "a"
        with pytest.raises(NoWorkerError):
            await placement.route_decode(RouteQuery("r", [1], "t", ["a", "b"]))

    asyncio.run(scenario())


def test_decision_load_parts() -> None:
    d = RouteDecision(None, WorkerRef("m", "h:1", "mixed"), ("p",), ("d",))
    assert d.load_lease_ids == ("p", "d")
    assert d.prefill_load().load_lease_ids == ("p",)
    assert d.decode_load().load_lease_ids == ("d",)

"""Adapter-aware placement: a LoRA adapter's requests are keyed with its digest (their
own prefix-cache keys, shared among themselves), and the workers that hold the adapter,
as their registrations say, come first in every pool, disaggregated too, while the
load bound still holds."""

from __future__ import annotations

import redis

from engine.adapter_ref import AdapterRef
from services.router.keyspace import Keyspace
from services.router.membership import MembershipView
from services.router.placement import RouteDecision, RouteQuery
from services.router.registry import Registry
from services.router.router import Router
from services.router.router_config import RouterConfig
from tests.unit.router.conftest import worker

ALPHA = AdapterRef("alpha", "a" * 32)


def _cluster(client: redis.Redis, namespace: str, holders: dict[str, tuple[str, ...]]) -> Router:
    registry = Registry(client, Keyspace(namespace), ttl_s=30.0)
    for wid in ("p0", "p1", "p2", "d0", "d1", "d2"):
        role = "prefill" if wid[0] == "p" else "decode"
        registry.register(worker(wid, role, adapters=holders.get(wid, ())))
    router = Router(client, RouterConfig(namespace=namespace, eps=0.5))
    router.refresh()
    return router


def test_registrations_carry_the_adapters(client: redis.Redis, namespace: str) -> None:
    registry = Registry(client, Keyspace(namespace), ttl_s=30.0)
    registry.register(worker("m0", adapters=("alpha", "beta")))
    registry.register(worker("m1"))
    listed = {w.worker_id: w.adapters for w in registry.list()}
    assert listed == {"m0": ("alpha", "beta"), "m1": ()}
    registry.heartbeat(worker("m0", adapters=("beta",)))  # each beat says what it holds now
    assert {w.worker_id: w.adapters for w in registry.list()}["m0"] == ("beta",)


def test_holders_come_first_in_ring_order() -> None:
    infos = {w: worker(w, "decode", adapters=("alpha",) if w in ("d1", "d3") else ())
             for w in ("d0", "d1", "d2", "d3")}  # fmt: skip
    view = MembershipView(pools={"decode": infos})
    assert view.holders_first("decode", ["d2", "d3", "d0", "d1"], "alpha") == [
        "d3",
        "d1",
        "d2",
        "d0",
    ]
    assert view.holders_first("decode", ["d2", "d0"], "beta") == ["d2", "d0"]


def test_an_adapters_requests_go_to_its_holders_in_both_pools(
    client: redis.Redis, namespace: str
) -> None:
    router = _cluster(client, namespace, {"p1": ("alpha",), "d2": ("alpha", "beta")})
    for i in range(6):  # different prompts, one at a time: each to the holders
        d = router.route(RouteQuery(f"r{i}", list(range(i * 50, i * 50 + 40)), "t", adapter=ALPHA))
        assert d.prefill is not None and d.prefill.worker_id == "p1"
        assert d.decode.worker_id == "d2"
        router.release(d.load_lease_ids)
    # At once, past the load bound the holder is skipped, as any worker would be.
    many = [
        router.route(RouteQuery(f"s{i}", list(range(i * 50, i * 50 + 40)), "t", adapter=ALPHA))
        for i in range(6)
    ]
    assert many[0].decode.worker_id == "d2" and {d.decode.worker_id for d in many} != {"d2"}
    for d in many:
        router.release(d.load_lease_ids)
    base = [
        router.route(RouteQuery(f"b{i}", list(range(i * 50, i * 50 + 40)), "t")) for i in range(12)
    ]
    assert len({d.decode.worker_id for d in base}) > 1  # the base model: the plain ring
    for d in base:
        router.release(d.load_lease_ids)
    assert router.ledger.snapshot("decode").counts == {}


def test_an_adapters_key_is_its_own(client: redis.Redis, namespace: str) -> None:
    """The cache model vouches for a prefix only to requests of the same adapter."""
    router = _cluster(client, namespace, {})
    prompt = list(range(100))

    def route(adapter: AdapterRef | None) -> RouteDecision:
        decision = router.route(RouteQuery("r", prompt, "t", adapter=adapter))
        router.release(decision.load_lease_ids)
        return decision

    first, same = route(ALPHA), route(ALPHA)
    other, base = route(AdapterRef("beta", "b" * 32)), route(None)
    assert first.decode_cached_tokens == 0
    assert same.decode == first.decode and same.decode_cached_tokens > 0
    assert other.decode_cached_tokens == 0 and base.decode_cached_tokens == 0

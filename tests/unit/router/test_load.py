"""The bounded-load script against real Redis, checked step by step against a model."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from hypothesis import event, given, settings
from hypothesis import strategies as st

from services.router.keyspace import Keyspace
from services.router.load import MODES, LoadLedger, PlaceRequest, choose, load_bound
from services.router.registry import Registry
from services.router.ring import HashRing
from tests.unit.router.conftest import age_leases, register_pool, worker

WORKERS = [f"w{i}" for i in range(6)]
RING = HashRing(WORKERS, virtual_nodes=16)
KEYS = [0x1234, 2**63 + 17, 2**64 - 5, 987654321987]

ops = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["add", "remove", "drain"]), st.sampled_from(WORKERS)),
        st.tuples(st.just("route"), st.sampled_from(range(len(KEYS)))),
        st.tuples(st.just("route"), st.just(0)),  # a hot key, so the bound has to bite
        st.tuples(st.just("route"), st.just(0)),
        st.tuples(st.just("release"), st.integers(0, 10_000)),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(
    initial=st.sets(st.sampled_from(WORKERS), min_size=1),
    ops=ops,
    eps=st.sampled_from([0.05, 0.25, 1.0]),
    mode=st.sampled_from(MODES),
)
def test_script_matches_model_and_never_exceeds_the_bound(
    client: redis.Redis, initial: set[str], ops: list[tuple[str, object]], eps: float, mode: str
) -> None:
    keys = Keyspace(f"prop-{uuid.uuid4().hex[:12]}")
    registry = Registry(client, keys, ttl_s=30)
    ledger = LoadLedger(client, keys)
    registered: dict[str, bool] = {}  # worker -> draining
    loads: dict[str, int] = {}  # live leases per worker, dead or alive
    held: list[str] = []
    warm: dict[str, set[int]] = {}  # the cache model: keys placed on each worker
    rr = 0
    for op, arg in [("add", w) for w in sorted(initial)] + ops:
        if op == "add":
            registry.register(worker(str(arg)))
            registered.setdefault(str(arg), False)  # draining is sticky across heartbeats
        elif op == "remove":
            registry.deregister(str(arg))
            registered.pop(str(arg), None)
        elif op == "drain":
            assert registry.set_draining(str(arg)) == (arg in registered)
            if arg in registered:
                registered[str(arg)] = True
        elif op == "release" and held:
            lease = held.pop(int(str(arg)) % len(held))
            assert ledger.release([lease]) == 1
            loads[lease.rsplit(":", 1)[1]] -= 1
        elif op == "route":
            key = KEYS[int(str(arg))]
            order = list(RING.walk(key))  # includes dead workers on purpose
            live = [w for w in order if w in registered and not registered[w]]
            placed = ledger.place(PlaceRequest("mixed", order, mode, eps, 30, key, 3))
            if not live:
                assert placed is None
                continue
            rr += mode == "round_robin"
            before = [loads.get(w, 0) for w in live]
            holds = [key in warm.get(w, set()) for w in live]
            pick, bound, total = choose(mode, before, eps, rr, holds)
            assert placed is not None
            got = (placed.worker_id, placed.load, placed.bound)
            assert got == (live[pick], before[pick], bound)
            assert (placed.n, placed.total, placed.rank) == (len(live), total, pick)
            if mode in ("bounded", "cache_aware"):
                assert placed.load < load_bound(total, len(live), eps)
                if placed.rank:
                    event(f"{mode} placement went past the key's first worker")
            if mode == "cache_aware":
                warm.setdefault(placed.worker_id, set()).add(key)
            loads[placed.worker_id] = loads.get(placed.worker_id, 0) + 1
            held.append(placed.lease_id)
    snap = ledger.snapshot("mixed")
    assert snap.counts == {w: c for w, c in loads.items() if c}
    assert snap.leases == len(held)
    assert ledger.release(held) == len(held)
    assert ledger.snapshot("mixed").counts == {}


def test_bound_always_leaves_a_worker_below_it() -> None:
    for n in range(1, 20):
        for total in range(0, 200):
            assert load_bound(total, n, 0.01) * n > total  # so "bounded" always finds one


def test_leases_expire_and_late_release_is_a_noop(client: redis.Redis, namespace: str) -> None:
    register_pool(client, namespace, "mixed", 3)
    ledger = LoadLedger(client, Keyspace(namespace))
    order = ["m0", "m1", "m2"]
    short = [ledger.place(PlaceRequest("mixed", order, "bounded", 0.25, 10)) for _ in range(5)]
    long = ledger.place(PlaceRequest("mixed", order, "bounded", 0.25, 60))
    assert ledger.snapshot("mixed").total == 6
    assert age_leases(client, namespace, "mixed", 10) == 6  # the short ones are due now
    snap = ledger.snapshot("mixed")
    assert (snap.total, snap.leases, snap.expired) == (1, 1, 5)
    assert ledger.release([p.lease_id for p in short if p is not None]) == 0
    assert long is not None and ledger.release([long.lease_id]) == 1
    snap = ledger.snapshot("mixed")
    assert (snap.counts, snap.expired) == ({}, 5)  # a release is not an expiry


def test_expired_leases_are_purged_by_the_next_placement(
    client: redis.Redis, namespace: str
) -> None:
    register_pool(client, namespace, "mixed", 2)
    keys = Keyspace(namespace)
    ledger = LoadLedger(client, keys)
    for _ in range(4):
        ledger.place(PlaceRequest("mixed", ["m0", "m1"], "first", 0.25, 0.05))
    time.sleep(0.1)  # only a lower bound: any delay past the TTL is fine
    placed = ledger.place(PlaceRequest("mixed", ["m0", "m1"], "bounded", 0.25, 30))
    assert placed is not None and (placed.worker_id, placed.load, placed.total) == ("m0", 0, 0)
    assert client.zcard(keys.load("mixed")) == 1
    assert int(client.get(keys.expired("mixed")) or 0) == 4  # counted by the placement
    ledger.release([placed.lease_id])
    assert ledger.snapshot("mixed").expired == 4


def test_pipelined_pools_and_unknown_mode(client: redis.Redis, namespace: str) -> None:
    register_pool(client, namespace, "prefill", 2)
    register_pool(client, namespace, "decode", 2)
    ledger = LoadLedger(client, Keyspace(namespace))
    p, d = ledger.place_many(
        [
            PlaceRequest("prefill", ["p1", "p0"], "bounded", 0.25, 30),
            PlaceRequest("decode", ["d0", "d1"], "bounded", 0.25, 30),
        ]
    )
    assert p is not None and d is not None and (p.worker_id, d.worker_id) == ("p1", "d0")
    assert ledger.release([p.lease_id, d.lease_id]) == 2
    with pytest.raises(ValueError, match="unknown placement mode"):
        ledger.place(PlaceRequest("decode", ["d0"], "nope", 0.25, 30))


def test_cache_model_prefers_a_warm_worker_and_evicts_at_capacity(
    client: redis.Redis, namespace: str
) -> None:
    keys = Keyspace(namespace)
    registry = Registry(client, keys, ttl_s=30)
    for w in ("m0", "m1", "m2"):
        registry.register(worker(w, capacity=10))
    ledger = LoadLedger(client, keys)

    def place(order: list[str], key: int) -> str:
        placed = ledger.place(PlaceRequest("mixed", order, "cache_aware", 1.0, 30, key, 4, 1.0))
        assert placed is not None
        ledger.release([placed.lease_id])
        return placed.worker_id

    assert place(["m0", "m1", "m2"], 0xA) == "m0"  # cold: the walk's first worker
    assert place(["m1", "m2", "m0"], 0xA) == "m0"  # warm beats the walk's first
    assert place(["m0", "m1", "m2"], 0xB) == "m0"
    assert place(["m0", "m1", "m2"], 0xC) == "m0"  # 12 blocks > capacity 10: A evicted
    weights = client.hgetall(keys.cache_weights("mixed", "m0"))
    assert weights == {"~used": "8", f"{0xB:016x}": "4", f"{0xC:016x}": "4"}
    assert place(["m1", "m2", "m0"], 0xA) == "m1"  # nobody holds A any more
    assert 0 < client.pttl(keys.cache_lru("mixed", "m0")) <= 3_600_000


def test_cache_model_never_beats_the_bound(client: redis.Redis, namespace: str) -> None:
    register_pool(client, namespace, "mixed", 2)
    ledger = LoadLedger(client, Keyspace(namespace))
    held = []
    for _ in range(6):  # one hot key: its warm worker fills to the bound, then m1 takes over
        placed = ledger.place(PlaceRequest("mixed", ["m0", "m1"], "cache_aware", 0.25, 30, 7, 1))
        assert placed is not None and placed.load < placed.bound
        held.append(placed)
    assert {p.worker_id for p in held} == {"m0", "m1"}
    assert ledger.release([p.lease_id for p in held]) == 6

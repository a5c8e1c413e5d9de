"""The index the workers feed: their reported sets in Redis, the feed that keeps one up
to date, and placement by the longest prefix actually resident.

All on the session's real embedded Redis. Placement tests register three mixed workers
with incarnations and write their reports with `ResidencyBoard`, as each worker's feed
does, then check where the real placement script sends a prompt.
"""

from __future__ import annotations

import pytest
import redis

from engine.prefix_hash import prefix_block_hashes
from engine.residency import ResidencyLog
from services.router import residency
from services.router.keyspace import Keyspace
from services.router.load import LoadLedger, PlaceRequest
from services.router.placement import RouteQuery
from services.router.prefix_key import tenant_seed
from services.router.registry import Registry
from services.router.residency import ResidencyBoard
from services.router.router import Router
from services.router.router_config import RouterConfig
from services.worker.residency_feed import ResidencyFeed
from tests.unit.router.conftest import MODEL, worker

TTL_S = 30.0
PROMPT = list(range(1000, 1000 + 16 * 10 + 5))  # ten full blocks and a tail
BLOCKS = prefix_block_hashes(PROMPT, 16, tenant_seed(MODEL, "t"))


def _board(client: redis.Redis, namespace: str) -> ResidencyBoard:
    return ResidencyBoard(client, Keyspace(namespace), TTL_S)


def test_a_set_is_replaced_changed_and_refused_to_other_incarnations(
    client: redis.Redis, namespace: str
) -> None:
    board = _board(client, namespace)
    assert board.read("w") is None
    assert not board.apply("w", "a", [1], [])  # nothing to apply to: the feed must reset
    assert board.read("w") is None
    many = range(1, 2501)  # more than one SADD chunk of the script
    board.reset("w", "a", many)
    got = board.read("w")
    assert got is not None and got.incarnation == "a" and got.hashes == frozenset(many)
    assert board.apply("w", "a", [2**64 - 1], [1, 2])
    got = board.read("w")
    assert got is not None and got.hashes == frozenset([*range(3, 2501), 2**64 - 1])
    assert not board.apply("w", "b", [7], [3])  # another process's set: left alone
    assert board.read("w") == got
    assert 0 < client.pttl(Keyspace(namespace).resident("w")) <= TTL_S * 1000
    board.withdraw("w")
    assert board.read("w") is None


def test_a_large_snapshot_goes_in_several_calls(
    client: redis.Redis, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(residency, "CALL_HASHES", 1000)
    board = _board(client, namespace)
    calls: list[str] = []
    script = board._script

    def counted(*, keys: list[str], args: list[object]) -> object:
        calls.append(str(args[0]))
        return script(keys=keys, args=args)

    monkeypatch.setattr(board, "_script", counted)
    board.reset("w", "a", range(3500))
    assert calls == ["reset", "apply", "apply", "apply"]
    got = board.read("w")
    assert got is not None and got.hashes == frozenset(range(3500))


def test_the_feed_sends_a_snapshot_then_changes_and_resyncs_after_a_loss(
    client: redis.Redis, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    board, log = _board(client, namespace), ResidencyLog()
    feed = ResidencyFeed(board, log, "w", "inc1")

    def reported() -> frozenset[int]:
        got = board.read("w")
        assert got is not None and got.incarnation == "inc1"
        return got.hashes

    for h in (1, 2, 3):
        log.add(h)
    feed.publish()
    assert reported() == {1, 2, 3} and feed.snapshots == 1
    log.remove(2)
    log.add(4)
    feed.publish()
    assert reported() == {1, 3, 4} and feed.snapshots == 1  # a delta
    client.delete(Keyspace(namespace).resident("w"))  # Redis lost it (restart, failover)
    log.add(5)
    feed.publish()
    assert reported() == {1, 3, 4, 5} and feed.snapshots == 2  # resent whole, same call

    def broken(*_: object) -> bool:
        raise redis.ConnectionError("Redis went away mid-publish")

    log.remove(1)
    with monkeypatch.context() as patch:
        patch.setattr(board, "apply", broken)
        with pytest.raises(redis.ConnectionError):
            feed.publish()  # the drained change is lost with the call...
    feed.publish()
    assert reported() == {3, 4, 5} and feed.snapshots == 3  # ...and the snapshot has it
    feed.withdraw()
    assert board.read("w") is None


def _cluster(client: redis.Redis, namespace: str, **config: object) -> Router:
    registry = Registry(client, Keyspace(namespace), ttl_s=TTL_S)
    for i in range(3):
        registry.register(worker(f"m{i}", incarnation=f"i{i}"))
    r = Router(client, RouterConfig(namespace=namespace, **config))  # type: ignore[arg-type]
    r.refresh()
    return r


def _route(r: Router, rid: str) -> tuple[str, int]:
    """(worker, cached tokens) of a placement of PROMPT, its lease given back."""
    d = r.route(RouteQuery(rid, PROMPT, "t"))
    r.release(d.load_lease_ids)
    return d.decode.worker_id, d.decode_cached_tokens


def test_the_longest_reported_run_wins_below_the_bound(client: redis.Redis, namespace: str) -> None:
    r = _cluster(client, namespace)
    board = _board(client, namespace)
    board.reset("m0", "i0", [])
    board.reset("m1", "i1", BLOCKS[:6])
    board.reset("m2", "i2", [*BLOCKS[:3], *BLOCKS[4:]])  # a hole: the run stops at it
    assert _route(r, "a") == ("m1", 6 * 16)
    s = r.stats
    assert (s.prefix_runs, s.prefix_best_runs) == (6, 6)
    # m1 at the bound (2 of ceil(1.25 * 3 / 3)): the next longest run takes it.
    ledger = LoadLedger(client, Keyspace(namespace))
    held = [ledger.place(PlaceRequest("mixed", ["m1"], "first", 0.25, TTL_S)) for _ in range(2)]
    assert _route(r, "b") == ("m2", 3 * 16)
    s = r.stats
    assert (s.prefix_runs, s.prefix_best_runs) == (9, 12)  # 6 were reachable, 3 placed
    ledger.release([p.lease_id for p in held if p is not None])
    board.reset("m2", "i2", BLOCKS[:6])
    loads = {"m1": 0, "m2": 0}
    for i in range(4):  # equal runs: the less loaded of the two, in turn
        d = r.route(RouteQuery(f"c{i}", PROMPT, "t"))
        loads[d.decode.worker_id] += 1
    assert loads == {"m1": 2, "m2": 2}


def test_a_restarted_worker_holds_nothing_until_it_reports_again(
    client: redis.Redis, namespace: str
) -> None:
    r = _cluster(client, namespace, membership_refresh_s=0)
    board = _board(client, namespace)
    board.reset("m0", "i0", [])
    board.reset("m1", "i1", BLOCKS)
    board.reset("m2", "i2", BLOCKS[:2])
    assert _route(r, "a")[0] == "m1"
    # m1 restarts: a new process registers; its old set is still there until it resets.
    Registry(client, Keyspace(namespace), ttl_s=TTL_S).register(worker("m1", incarnation="j1"))
    assert _route(r, "b") == ("m2", 2 * 16)
    board.reset("m1", "j1", BLOCKS[:5])  # the new process reports what it has since cached
    assert _route(r, "c") == ("m1", 5 * 16)


def test_workers_that_do_not_report_fall_back_on_the_cache_model(
    client: redis.Redis, namespace: str
) -> None:
    r = _cluster(client, namespace, prefix_blocks=4)
    first, cached = _route(r, "a")  # nobody reports: the ring's first, cold
    assert cached == 0
    assert _route(r, "b") == (first, 4 * 16)  # the model holds the key: 4 blocks' worth
    board = _board(client, namespace)
    other = next(w for w in ("m0", "m1", "m2") if w != first)
    board.reset(other, other.replace("m", "i"), BLOCKS[:7])
    assert _route(r, "c") == (other, 7 * 16)  # a reported 7 beats a modelled 4
    board.reset(first, first.replace("m", "i"), [])  # it reports: its word beats the model
    board.reset(other, other.replace("m", "i"), [])
    assert _route(r, "d")[1] == 0
    models_only = _cluster(client, namespace, match_blocks=0)
    assert _route(models_only, "e") == (first, 4 * 16)  # reports ignored: the model decides

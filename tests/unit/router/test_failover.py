"""After a Redis failover: inherited load leases trimmed to the workers' own counts.

The reconcile script runs on the session's real Redis (a failover is simulated by handing
`Failover` a new replication id); the last test fails over a real primary, replica and
three Sentinels (`EmbeddedRedisHA`) under a `Router`.
"""

from __future__ import annotations

import time

import pytest
import redis

from engine.stats import ClassCounts
from services.common.role import Role
from services.router.failover import Failover, ReconcileState, replication_id
from services.router.keyspace import Keyspace
from services.router.load import LoadLedger, PlaceRequest
from services.router.placement import RouteQuery
from services.router.redis_client import SentinelUrl, connect
from services.router.redis_ha import EmbeddedRedisHA
from services.router.router import Router
from services.router.router_config import RouterConfig
from services.router.worker_signal import SignalBoard, WorkerSignal
from tests.unit.router.conftest import register_pool

TTL_S = 600.0  # leases outlive the test: only the reconcile may remove them


def _place(client: redis.Redis, namespace: str, worker_id: str, n: int) -> list[str]:
    ledger = LoadLedger(client, Keyspace(namespace))
    req = PlaceRequest("decode", [worker_id], "first", 0.25, TTL_S)
    leases = [ledger.place(req) for _ in range(n)]
    return [p.lease_id for p in leases if p is not None]


def _publish(client: redis.Redis, namespace: str, worker_id: str, running: int) -> None:
    board = SignalBoard(client, Keyspace(namespace), ttl_s=30.0)
    signal = WorkerSignal(worker_id, Role.DECODE, ClassCounts(), waiting=1,
                          running=running - 1, free_blocks=10, total_blocks=10, block_size=16,
                          prefill_tokens_per_s=0.0, decode_step_s=0.0)  # fmt: skip
    board.publish(signal)


def _counts(client: redis.Redis, namespace: str) -> dict[str, int]:
    return LoadLedger(client, Keyspace(namespace)).snapshot("decode").counts


def _failed_over(client: redis.Redis, namespace: str, give_up_s: float = 30.0) -> Failover:
    failover = Failover(client, Keyspace(namespace), TTL_S, give_up_s)
    assert not failover.observe("old-primary")  # the first id seen is no change
    assert failover.observe("new-primary") and failover.owed
    return failover


def test_inherited_leases_are_trimmed_to_what_the_worker_runs(
    client: redis.Redis, namespace: str
) -> None:
    register_pool(client, namespace, "decode", 2)  # d0, d1
    inherited = _place(client, namespace, "d0", 5)
    _place(client, namespace, "d1", 3)
    _publish(client, namespace, "d0", 2)  # published before the failover was seen
    failover = _failed_over(client, namespace)

    first = failover.reconcile(["decode"])
    assert [r.state for r in first] == [ReconcileState.PENDING]  # d0's signal predates it
    assert failover.owed and _counts(client, namespace) == {"d0": 5, "d1": 3}

    placed_after = _place(client, namespace, "d0", 1)  # on the new primary: never trimmed
    _publish(client, namespace, "d0", 2)
    done = failover.reconcile(["decode"])
    assert [(r.state, r.trimmed) for r in done] == [(ReconcileState.DONE, 4)]
    assert not failover.owed
    # d0 runs 2: one inherited lease and the new one are left; d1 has no signal, untouched.
    assert _counts(client, namespace) == {"d0": 2, "d1": 3}
    left = set(client.zrange(Keyspace(namespace).load("decode"), 0, -1))
    assert set(placed_after) <= left and len(left & set(inherited)) == 1

    # Another router that saw the same failover finds it done, and a release of a trimmed
    # lease is a no-op (the count never goes below what is left).
    other = _failed_over(client, namespace)
    assert [(r.state, r.trimmed) for r in other.reconcile(["decode"])] == [
        (ReconcileState.ALREADY, 0)
    ]
    assert LoadLedger(client, Keyspace(namespace)).release(inherited) == 1
    assert _counts(client, namespace) == {"d0": 1, "d1": 3}


def test_a_worker_that_never_republishes_is_skipped_after_the_give_up(
    client: redis.Redis, namespace: str
) -> None:
    register_pool(client, namespace, "decode", 1)
    _place(client, namespace, "d0", 3)
    _publish(client, namespace, "d0", 0)  # stale: predates the failover, never renewed
    failover = _failed_over(client, namespace, give_up_s=0.0)
    assert [(r.state, r.trimmed) for r in failover.reconcile(["decode"])] == [
        (ReconcileState.DONE, 0)
    ]
    assert _counts(client, namespace) == {"d0": 3}  # left to the leases' own expiry


def test_a_redis_that_refuses_info_never_looks_like_a_new_primary(
    client: redis.Redis, namespace: str
) -> None:
    failover = Failover(client, Keyspace(namespace), TTL_S, 30.0)
    assert not failover.observe(replication_id({"master_replid": "abc"}))
    # A managed Redis may refuse INFO: the pipeline hands back the error, not a dict.
    assert replication_id(redis.ResponseError("unknown command 'INFO'")) == ""
    assert not failover.observe("") and not failover.owed
    assert failover.reconcile(["decode"]) == []


def test_a_killed_primary_fails_over_and_the_router_follows() -> None:
    namespace = "ha-test"
    with EmbeddedRedisHA() as ha:
        client = connect(ha.url, 2.0)
        register_pool(client, namespace, "mixed", 2, ttl_s=600.0)
        config = RouterConfig(redis_url=ha.url, namespace=namespace, membership_refresh_s=0.0,
                              redis_retry_s=0.2)  # fmt: skip
        router = Router(connect(ha.url), config)
        query = RouteQuery("r", list(range(64)), "tenant")
        held = [router.route_detailed(query) for _ in range(4)]
        assert router.stats.fail_open == 0

        ha.kill_primary()
        killed = time.monotonic()
        while router.stats.failovers == 0:
            assert time.monotonic() - killed < 15.0, "the router never reached a new primary"
            held.append(router.route_detailed(query))  # local until the replica is promoted
            time.sleep(0.05)
        held.append(router.route_detailed(query))
        assert not held[-1].fail_open  # placed through the new primary
        # The replica had every lease (loopback replication keeps up): nothing to trim.
        assert router.stats.reconciled_leases == 0
        remote = [r.decision for r in held if not r.fail_open]
        ledger = LoadLedger(client, Keyspace(namespace))
        assert ledger.snapshot("mixed").total == len(remote)
        for routed in held:
            router.release(routed.decision.decode_lease_ids)
        assert ledger.snapshot("mixed").total == 0 and router.stats.owed_releases == 0


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://h1:26379,h2:26379/mymaster",
        "redis+sentinel://:pw%40x@h1:26379/mymaster/3",
    ],
)
def test_sentinel_urls_parse(url: str) -> None:
    parsed = SentinelUrl.parse(url)
    assert parsed.service == "mymaster" and parsed.sentinels[0] == ("h1", 26379)
    assert (parsed.db, parsed.password) in ((0, ""), (3, "pw@x"))


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://h1:26379",
        "redis+sentinel://h1/mymaster",
        "redis+sentinel://h1:26379/mymaster/zero",
        "redis+sentinel://h1:26379/a/b/c",
    ],
)
def test_malformed_sentinel_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="redis_url"):
        connect(url)

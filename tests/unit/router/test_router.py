from __future__ import annotations

import argparse
import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from services.common.config import add_config_args, config_from_args
from services.router.embedded_redis import EmbeddedRedis
from services.router.keyspace import Keyspace
from services.router.load import LoadLedger
from services.router.placement import NoWorkerError, RouteQuery
from services.router.redis_client import connect
from services.router.redis_placement import RedisPlacement
from services.router.registry import Registry
from services.router.router import Router
from services.router.router_config import RouterConfig
from tests.unit.router.conftest import register_pool, worker


def make_router(client: redis.Redis, namespace: str, **kw: object) -> Router:
    r = Router(client, RouterConfig(namespace=namespace, **kw))  # type: ignore[arg-type]
    r.refresh()
    return r


def test_disaggregated_decision_and_release(client: redis.Redis, namespace: str) -> None:
    register_pool(client, namespace, "prefill", 2)
    register_pool(client, namespace, "decode", 3)
    r = make_router(client, namespace)
    d = r.route(RouteQuery("r1", list(range(70)), "tenant"))
    assert d.prefill is not None and d.prefill.role == "prefill" and d.decode.role == "decode"
    assert d.prefill.address == f"addr-{d.prefill.worker_id}"
    assert len(d.load_lease_ids) == 2
    # Same prefix, same tenant: same prefill worker (the one whose cache holds it).
    again = r.route(RouteQuery("r2", [*range(64), 9, 9], "tenant"))
    assert again.prefill == d.prefill
    r.release(d.load_lease_ids)
    r.release(again.load_lease_ids)
    assert r.ledger.snapshot("prefill").counts == r.ledger.snapshot("decode").counts == {}
    assert {w.worker_id for w in r.workers()} == {"p0", "p1", "d0", "d1", "d2"}


def test_a_warm_decode_worker_vouches_for_the_prefix_it_caches(
    client: redis.Redis, namespace: str
) -> None:
    """The decision says how much of the prompt the router's model of the decode worker's
    prefix cache holds (conditional disaggregation reads it): nothing for a new prefix,
    the full blocks the key covers once the model has it (at most `prefix_blocks`), never
    the last token."""
    register_pool(client, namespace, "prefill", 1)
    register_pool(client, namespace, "decode", 2)
    r = make_router(client, namespace, prefix_blocks=2, block_size=16)
    cold = r.route(RouteQuery("r1", list(range(100)), "tenant"))
    warm = r.route(RouteQuery("r2", [*range(40), 7, 7, 7], "tenant"))  # the same first 2 blocks
    short = r.route(RouteQuery("r3", list(range(20)), "other"))  # the key covers one block
    again = r.route(RouteQuery("r4", list(range(20)), "other"))
    assert cold.decode_cached_tokens == 0 and short.decode_cached_tokens == 0
    assert warm.decode == cold.decode and warm.decode_cached_tokens == 32
    assert again.decode_cached_tokens == 16
    tiny = r.route(RouteQuery("r6", list(range(9)), "other"))  # no full block: the whole key
    tiny_again = r.route(RouteQuery("r7", list(range(9)), "other"))
    assert tiny.decode_cached_tokens == 0 and tiny_again.decode_cached_tokens == 8
    other_tenant = r.route(RouteQuery("r5", list(range(100)), "someone-else"))
    assert other_tenant.decode_cached_tokens == 0  # tenants never share keys
    for d in (cold, warm, short, again, other_tenant, tiny, tiny_again):
        r.release(d.load_lease_ids)
    assert r.ledger.snapshot("decode").counts == {}


def test_draining_worker_gets_no_new_requests(client: redis.Redis, namespace: str) -> None:
    register_pool(client, namespace, "mixed", 3)
    r = make_router(client, namespace, membership_refresh_s=60)
    reg = Registry(client, Keyspace(namespace))
    reg.set_draining("m1")
    # The router's view is stale (refresh in 60 s): the script itself skips m1 at once.
    placed = {r.route(RouteQuery(str(i), [i] * 40, "t")).decode.worker_id for i in range(200)}
    assert placed == {"m0", "m2"}
    r.refresh()
    assert "m1" not in r.membership.view().ring("mixed")
    reg.set_draining("m0")
    reg.set_draining("m2")
    with pytest.raises(NoWorkerError, match="3 registered, 3 draining"):
        r.route(RouteQuery("x", [1] * 40, "t"))


def test_exclude_skips_failed_workers(client: redis.Redis, namespace: str) -> None:
    register_pool(client, namespace, "mixed", 2)
    r = make_router(client, namespace)
    first = r.route(RouteQuery("r", [5] * 40, "t")).decode.worker_id
    other = r.route(RouteQuery("r", [5] * 40, "t", exclude=[first])).decode.worker_id
    assert other != first
    with pytest.raises(NoWorkerError, match="2 already tried"):
        r.route(RouteQuery("r", [5] * 40, "t", exclude=["m0", "m1"]))


def test_dead_worker_is_dropped_via_refresh_and_retry(client: redis.Redis, namespace: str) -> None:
    register_pool(client, namespace, "mixed", 1)
    r = make_router(client, namespace, membership_refresh_s=60)
    reg = Registry(client, Keyspace(namespace))
    reg.deregister("m0")
    reg.register(worker("m9"))
    # The view still says m0; the script finds it gone, the router re-reads and retries.
    assert r.route(RouteQuery("r", [1] * 40, "t")).decode.worker_id == "m9"


def test_no_workers_prefill_workers_alone_and_a_lone_decode_pool(
    client: redis.Redis, namespace: str
) -> None:
    """With no worker a route fails, and with prefill workers alone (every decode worker
    lost); a lone decode pool (its prefill worker changed role at run time) serves whole
    requests, as a mixed pool does."""
    r = make_router(client, namespace)
    with pytest.raises(NoWorkerError, match="no worker is registered"):
        r.route(RouteQuery("r", [1], "t"))
    register_pool(client, namespace, "prefill", 1)
    r.refresh()
    with pytest.raises(NoWorkerError, match="no decode worker"):
        r.route(RouteQuery("r", [1], "t"))
    register_pool(client, namespace, "decode", 1)
    r.refresh()
    split = r.route(RouteQuery("r", [1], "t"))
    assert (split.prefill and split.prefill.worker_id, split.decode.worker_id) == ("p0", "d0")
    r.release(split.load_lease_ids)
    Registry(client, Keyspace(namespace)).deregister("p0")
    r.refresh()
    whole = r.route(RouteQuery("r", [1], "t"))
    assert whole.prefill is None and whole.decode.worker_id == "d0"


def test_router_config_flags_env_and_validation() -> None:
    parser = argparse.ArgumentParser()
    add_config_args(parser, RouterConfig, env={"PDSERVE_EPS": "0.5", "PDSERVE_POLICY": "random"})
    cfg = config_from_args(RouterConfig, parser.parse_args(["--prefix-blocks", "2"]))
    assert (cfg.eps, cfg.policy, cfg.prefix_blocks, cfg.redis_url) == (0.5, "random", 2, "")
    with pytest.raises(ValueError, match="policy"):
        RouterConfig(policy="sticky")
    with pytest.raises(ValueError, match="eps"):
        RouterConfig(eps=0)


def test_redis_placement_with_its_own_embedded_redis() -> None:
    placement = RedisPlacement.from_config(RouterConfig(redis_url=""))
    try:
        reg = Registry(placement.client, Keyspace("pdserve"))
        reg.register(worker("m0"))
        placement.router.refresh()

        async def go() -> None:
            d = await placement.route(RouteQuery("r", [1, 2, 3], "t"))
            assert d.decode.worker_id == "m0" and d.prefill is None
            await placement.release(d)

        asyncio.run(go())
        assert placement.router.ledger.snapshot("mixed").counts == {}
        assert [w.worker_id for w in placement.workers()] == ["m0"]
        pid = placement._embedded.pid if placement._embedded else None
    finally:
        placement.close()
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_cancelled_release_still_gives_the_load_back(client: redis.Redis, namespace: str) -> None:
    """A release whose caller is cancelled while its job waits for a thread still runs
    (cancelling the job would leave the load counted until the lease TTL)."""
    register_pool(client, namespace, "prefill", 1)
    register_pool(client, namespace, "decode", 1)
    placement = RedisPlacement(make_router(client, namespace))
    decision = placement.router.route(RouteQuery("r", list(range(40)), "t"))
    blocker = threading.Event()

    async def go() -> None:
        loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(max_workers=1)
        loop.set_default_executor(pool)
        busy = loop.run_in_executor(None, blocker.wait)  # the one thread is taken
        releasing = asyncio.ensure_future(placement.release(decision))
        await asyncio.sleep(0.05)  # the release job is queued behind `busy`
        releasing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await releasing
        blocker.set()
        await busy
        pool.shutdown(wait=True)  # runs what is still queued

    asyncio.run(go())
    ledger = placement.router.ledger
    assert ledger.snapshot("prefill").counts == ledger.snapshot("decode").counts == {}


def test_release_cancelled_before_its_first_step_still_gives_the_load_back(
    client: redis.Redis, namespace: str
) -> None:
    """The gateway's cleanup gathers its releases and can be cancelled again before the
    gathered ones have run a step; a release that started its work on its first step
    was dropped then (the soak test's leaked prefill + decode lease, ~1 run in 5)."""
    register_pool(client, namespace, "prefill", 1)
    register_pool(client, namespace, "decode", 1)
    placement = RedisPlacement(make_router(client, namespace))
    decision = placement.router.route(RouteQuery("r", list(range(40)), "t"))

    async def go() -> None:
        releasing = asyncio.gather(placement.release(decision))
        releasing.cancel()  # before the loop has run anything
        with pytest.raises(asyncio.CancelledError):
            await releasing

    asyncio.run(go())  # waits for the default executor's queued jobs on the way out
    ledger = placement.router.ledger
    assert ledger.snapshot("prefill").counts == ledger.snapshot("decode").counts == {}


def test_release_while_redis_is_down_is_sent_once_it_answers(
    redis_server: EmbeddedRedis, namespace: str
) -> None:
    """A release the router skips (Redis counted as down after a slow reply) is kept and
    sent with the next call that reaches Redis, not left counted until the load TTL."""
    client = connect(redis_server.url, timeout_s=0.2)
    register_pool(client, namespace, "prefill", 1)
    register_pool(client, namespace, "decode", 1)
    router = make_router(client, namespace, redis_retry_s=30.0)
    decision = router.route(RouteQuery("r", list(range(40)), "t"))
    admin = connect(redis_server.url, timeout_s=10.0)
    # 1.5 s against a 0.2 s timeout: the refresh times out unless the host stalls 1.3 s.
    admin.execute_command("CLIENT", "PAUSE", 1500, "ALL")
    assert router.refresh() is False  # times out: Redis counts as down for 30 s
    router.release(decision.load_lease_ids)  # skipped, nothing sent: kept
    assert router.stats.owed_releases == router.stats.release_failures == 2
    admin.ping()  # answered once the pause is over (no fixed sleep to race)
    ledger = LoadLedger(admin, Keyspace(namespace))
    assert ledger.snapshot("decode").total == ledger.snapshot("prefill").total == 1
    assert router.refresh() is True  # reaches Redis: the kept releases go with it
    assert router.stats.owed_releases == 0
    assert ledger.snapshot("prefill").counts == ledger.snapshot("decode").counts == {}
    admin.close()
    client.close()

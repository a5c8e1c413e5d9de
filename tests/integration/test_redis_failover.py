"""Kill -9 the Redis primary under load: a real 1 prefill + 1 decode cluster on the
embedded primary, replica and three Sentinels (`--redis-ha`).

While clients keep four streams going, the primary is killed. The Sentinels promote the
replica; every component finds it through them. Checked: every request succeeds; the
gateway's router reaches the new primary, and places through it again, within
`RESUME_S` of the kill (RELIABILITY.md states the same bound); the load reconcile ran
once per pool; a rollout's state and the tenants' fair-share ledger are still there;
and the leak probe finds nothing held, load leases in Redis included.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from pdserve.v1 import gateway_pb2
from services.cluster.local_cluster import LocalCluster
from services.common.metrics import scrape
from services.gateway.client import GatewayClient, RequestOptions, build_request
from services.gateway.flow.fair_share import FairShare
from services.router.keyspace import Keyspace
from services.router.redis_client import connect
from services.router.redis_ha import EmbeddedRedisHA
from services.router.rollout_store import RolloutPhase, RolloutStore
from tests.integration.cluster_drills import serve
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.test_cluster import _cluster

# Kill to placing through the new primary: the Sentinels' down-after (1 s) and election,
# then the router's retry (--redis-retry-s, 1 s) and its next registry refresh (1 s).
RESUME_S = 6.0
STREAMS = 4


@pytest.fixture(scope="module")
def ha_cluster() -> Iterator[LocalCluster]:
    cluster = _cluster(num_prefill=1, num_decode=1, redis_ha=True)
    yield cluster
    cluster.stop()


async def _keep_serving(address: str, stop: asyncio.Event, codes: list[grpc.StatusCode]) -> None:
    """Send short requests one after another until `stop` is set; record each outcome."""
    async with GatewayClient(address) as client:
        i = 0
        while not stop.is_set():
            i += 1
            request = build_request(f"Failover drill {i}: name a river.",
                                    RequestOptions(max_tokens=6, ignore_eos=True))  # fmt: skip
            try:
                msgs: list[gateway_pb2.GenerateResponse] = [
                    m async for m in client.generate(request)
                ]
                codes.append(grpc.StatusCode.OK if msgs[-1].finished else grpc.StatusCode.UNKNOWN)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())


def _router_metric(cluster: LocalCluster, name: str) -> float:
    port = cluster.gateways[0].metrics_port
    assert port is not None
    return scrape(port).get(f"pdserve_router_{name}", 0.0)


def _until_failover_seen(cluster: LocalCluster, killed_at: float) -> float:
    while _router_metric(cluster, "failovers_total") < 1:
        assert time.monotonic() - killed_at < 30.0, "the gateway never saw a new primary"
        time.sleep(0.05)
    return time.monotonic() - killed_at


def test_killing_the_redis_primary_under_load_loses_nothing(ha_cluster: LocalCluster) -> None:
    ha = ha_cluster.redis
    assert isinstance(ha, EmbeddedRedisHA)
    client = connect(ha.url, 2.0)
    rollouts = RolloutStore(client, "pdserve")
    rollouts.start("survivor", "v2", 0.25)  # a model nobody serves: its state is the point
    asyncio.run(serve(ha_cluster, 3, "ha-warm"))
    tenants_before = FairShare(client, "pdserve").sync({}, {}).classes
    assert any(tenants_before.values()), "the fair-share ledger should have a tenant"
    probe = start_probe(ha_cluster)

    codes: list[grpc.StatusCode] = []

    async def under_load() -> tuple[float, float]:
        stop = asyncio.Event()
        load = [_keep_serving(ha_cluster.gateway_address, stop, codes) for _ in range(STREAMS)]
        tasks = [asyncio.create_task(c) for c in load]
        await asyncio.sleep(2.0)
        old_port = ha.kill_primary()
        killed_at = time.monotonic()
        promoted = await asyncio.to_thread(ha.wait_promoted, old_port)
        seen = await asyncio.to_thread(_until_failover_seen, ha_cluster, killed_at)
        await asyncio.sleep(3.0)  # still under load on the new primary
        stop.set()
        await asyncio.gather(*tasks)
        ha.restart(old_port)  # back as the new primary's replica, for the next test
        return promoted, seen

    promoted, seen = asyncio.run(under_load())
    assert codes and set(codes) == {grpc.StatusCode.OK}, f"{len(codes)} requests: {codes}"
    assert seen < RESUME_S, (
        f"new primary seen {seen:.1f} s after the kill (promoted {promoted:.1f} s)"
    )

    fail_open = _router_metric(ha_cluster, "fail_open_total")
    asyncio.run(serve(ha_cluster, 3, "ha-after"))
    assert _router_metric(ha_cluster, "fail_open_total") == fail_open  # placed in Redis

    replid = str(client.info("replication")["master_replid"])
    keys = Keyspace("pdserve")
    assert {client.get(keys.reconcile(replid, r)) for r in ("prefill", "decode")} == {"done"}
    survivor = rollouts.read("survivor")
    assert (survivor.phase, survivor.canary, survivor.weight) == (RolloutPhase.RUNNING, "v2", 0.25)
    tenants_after = FairShare(client, "pdserve").sync({}, {}).classes
    for priority, tenants in tenants_before.items():
        assert set(tenants) <= set(tenants_after.get(priority, {})), "a tenant's share was lost"
    assert_cluster_clean(probe)

"""The leak probe against a real Redis (load leases, quota windows), a real gRPC server
whose Stats come from a real `LeaseTable`, and a real Prometheus page: clean when
nothing is held, and a failure for each kind of leak. The one stand-in is the worker
servicer, which serves only Stats (a real worker needs the model)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client import CollectorRegistry, Gauge

from kvtransfer.leases import LeaseTable
from loadtest.reliability.leak_probe import (
    HELD_GAUGE,
    HELD_RESOURCES,
    LeakProbe,
    LeaseTtls,
    ProbeTarget,
    WorkerRef,
)
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.common.metrics import MetricsServer
from services.gateway.access.quota import TokenQuota
from services.router.embedded_redis import EmbeddedRedis
from services.router.keyspace import Keyspace
from services.router.load import LoadLedger, PlaceRequest
from services.router.redis_client import connect
from tests.unit.router.conftest import age_leases, register_pool

KV_TTL_S = 4.0
LOAD_TTL_S = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class StatsOnlyWorker(worker_pb2_grpc.WorkerServicer):
    """Serves a prefill worker's Stats from a real lease table (nothing else)."""

    def __init__(self, leases: LeaseTable) -> None:
        self.leases = leases

    async def Stats(
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStats:
        s = self.leases.stats()
        return worker_pb2.WorkerStats(
            worker_id="prefill-0", role="prefill", used_blocks=s.pinned_blocks,
            held_blocks=s.pinned_blocks, active_leases=s.active, expired_leases=s.expired,
        )  # fmt: skip


@dataclass
class Rig:
    leases: LeaseTable
    clock: Clock
    held: Gauge
    active: Gauge  # the gateway's streams, by model
    ledger: LoadLedger
    quota: TokenQuota
    target: ProbeTarget


@pytest.fixture(scope="module")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@asynccontextmanager
async def rig(redis_server: EmbeddedRedis, *, with_gauge: bool = True) -> AsyncIterator[Rig]:
    clock = Clock()
    leases = LeaseTable(KV_TTL_S, on_release=lambda rid: None, clock=clock)
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(StatsOnlyWorker(leases), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    registry = CollectorRegistry()
    held = Gauge(HELD_GAUGE, "request records holding a resource", ["resource"],
                 registry=registry)  # fmt: skip
    for resource in HELD_RESOURCES if with_gauge else ():
        held.labels(resource=resource).set(0)
    active = Gauge("pdserve_active_streams", "streams", ["model"], registry=registry)
    active.labels("a").set(0)
    metrics = MetricsServer(registry, "127.0.0.1", 0)
    namespace = f"probe-{uuid.uuid4().hex[:8]}"
    client = connect(redis_server.url, 2.0)
    register_pool(client, namespace, "decode", 1)
    worker = WorkerRef("prefill-0", f"127.0.0.1:{port}", "1")
    target = ProbeTarget(lambda: [worker], LeaseTtls(KV_TTL_S, LOAD_TTL_S),
                         lambda: redis_server.url, namespace, (metrics.port,))  # fmt: skip
    try:
        yield Rig(leases, clock, held, active, LoadLedger(client, Keyspace(namespace)),
                  TokenQuota(client, namespace), target)  # fmt: skip
    finally:
        metrics.close()
        await server.stop(None)
        client.close()


def scenario(
    redis_server: EmbeddedRedis, body: Callable[[Rig], Awaitable[None]], **kw: bool
) -> None:
    async def go() -> None:
        async with rig(redis_server, **kw) as r:
            await body(r)

    asyncio.run(go())


def place(r: Rig) -> str:
    placed = r.ledger.place(PlaceRequest("decode", ["d0"], "bounded", 0.25, LOAD_TTL_S))
    assert placed is not None
    return placed.lease_id


def test_wait_bound_is_half_the_shortest_ttl() -> None:
    assert LeaseTtls(kv_s=5.0, load_s=60.0).wait_bound_s == 2.5
    assert LeaseTtls(kv_s=30.0, load_s=3.0).wait_bound_s == 1.5
    assert LeaseTtls(kv_s=30.0, load_s=None).wait_bound_s == 15.0


def test_released_leases_read_clean(redis_server: EmbeddedRedis) -> None:
    async def body(r: Rig) -> None:
        probe = await LeakProbe.start(r.target)
        lease = r.leases.grant("req", [1, 2])
        assert r.leases.release(lease.lease_id)
        r.ledger.release([place(r)])
        leaks = await probe.wait_clean()
        assert leaks.clean, leaks

    scenario(redis_server, body)


def test_unreleased_kv_lease_fails_before_its_ttl(redis_server: EmbeddedRedis) -> None:
    async def body(r: Rig) -> None:
        probe = await LeakProbe.start(r.target)
        r.leases.grant("req", [1, 2, 3])
        start = time.monotonic()
        leaks = await probe.wait_clean(timeout=60.0)  # capped at half the KV TTL
        assert time.monotonic() - start < KV_TTL_S
        assert not leaks.clean
        assert leaks.workers == {"prefill-0": {"used_blocks": 3, "held_blocks": 3,
                                               "active_leases": 1}}  # fmt: skip

    scenario(redis_server, body)


def test_expired_kv_lease_fails_though_nothing_is_held_any_more(
    redis_server: EmbeddedRedis,
) -> None:
    async def body(r: Rig) -> None:
        probe = await LeakProbe.start(r.target)
        r.leases.grant("req", [1, 2])
        r.clock.now += KV_TTL_S
        assert r.leases.expire_due() == 1  # unpinned by expiry: the worker looks idle
        leaks = await probe.wait_clean()
        assert leaks.workers == {} and leaks.expired_kv == {"prefill-0": 1}
        assert not leaks.clean
        assert (await probe.read(allow_expired_kv=1)).clean  # a fault test that expects it
        # A probe started after the expiry does not count it: only since its baseline.
        assert (await (await LeakProbe.start(r.target)).read()).clean

    scenario(redis_server, body)


def test_leftover_load_lease_fails_live_or_expired(redis_server: EmbeddedRedis) -> None:
    async def body(r: Rig) -> None:
        probe = await LeakProbe.start(r.target)
        place(r)
        leaks = await probe.read()
        assert leaks.load == {"decode": 1} and not leaks.clean
        assert age_leases(r.ledger.client, r.target.namespace, "decode", LOAD_TTL_S) == 1
        leaks = await probe.read()  # purged as expired: no live lease, still a leak
        assert leaks.load == {} and leaks.expired_load == {"decode": 1}
        assert not leaks.clean
        assert (await probe.read(allow_expired_load=1)).clean

    scenario(redis_server, body)


@pytest.mark.parametrize("resource", HELD_RESOURCES)
def test_held_gateway_resource_fails(redis_server: EmbeddedRedis, resource: str) -> None:
    async def body(r: Rig) -> None:
        probe = await LeakProbe.start(r.target)
        r.held.labels(resource=resource).set(1)
        leaks = await probe.read()
        assert leaks.gateway == {resource: 1.0} and not leaks.clean
        r.held.labels(resource=resource).set(0)
        assert (await probe.read()).clean

    scenario(redis_server, body)


def test_a_stream_left_active_for_any_model_fails(redis_server: EmbeddedRedis) -> None:
    async def body(r: Rig) -> None:
        probe = await LeakProbe.start(r.target)
        r.active.labels("b").set(1)  # a second model's series, beside a's 0
        leaks = await probe.read()
        assert leaks.gateway == {"pdserve_active_streams": 1.0} and not leaks.clean
        r.active.labels("b").set(0)
        assert (await probe.read()).clean
        r.active.labels("a").set(-1)  # a dec without its inc: as much a fault
        r.active.labels("b").set(1)
        assert (await probe.read()).gateway == {"pdserve_active_streams": 2.0}
        r.active.labels("a").set(0)
        r.active.labels("b").set(0)

    scenario(redis_server, body)


def test_missing_held_gauge_fails(redis_server: EmbeddedRedis) -> None:
    async def body(r: Rig) -> None:
        leaks = await (await LeakProbe.start(r.target)).read()
        assert not leaks.clean
        assert len(leaks.missing) == len(HELD_RESOURCES)
        assert all(HELD_GAUGE in m for m in leaks.missing)

    scenario(redis_server, body, with_gauge=False)


def test_quota_charge_must_equal_tokens_used(redis_server: EmbeddedRedis) -> None:
    async def body(r: Rig) -> None:
        probe = await LeakProbe.start(r.target)
        grant = r.quota.admit("tenant-c", 1000, prompt_tokens=10, max_tokens=50)
        used = {"tenant-c": 10 + 5}  # the request generated 5 of its 50 tokens
        leaks = await probe.read(quota_used=used)
        assert leaks.quota == {"tenant-c": 45} and not leaks.clean  # no refund yet
        r.quota.settle(grant, completion_tokens=5)
        assert (await probe.read(quota_used=used)).clean
        other = await probe.read(quota_used={"tenant-c": 15, "tenant-d": 3})
        assert other.quota == {"tenant-d": -3}  # told of use that was never charged

    scenario(redis_server, body)

"""Router service replicas on one real Redis, and a worker draining out of a live cluster
(which ends with the leak probe, `leak_check`)."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest

from pdserve.v1 import router_pb2, router_pb2_grpc
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from services.gateway.client import GatewayClient, RequestOptions, build_request
from services.router.embedded_redis import EmbeddedRedis
from services.router.keyspace import Keyspace
from services.router.load import LoadLedger
from services.router.redis_client import connect
from services.router.registry import Registry, WorkerInfo
from tests.conftest import MODEL_CACHE
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.peer import REPO
from tests.prompts import long_prompt


@pytest.fixture
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tcp=True) as server:
        yield server


def _start_router(url: str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "--die-with-parent", "router",
         "--redis-url", url, "--membership-refresh-s", "0", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready, "router did not start"
    return proc, json.loads(proc.stdout.readline())["ready"]


def test_router_replicas_share_load_through_redis(redis_server: EmbeddedRedis) -> None:
    client = connect(redis_server.url, 2.0)
    registry = Registry(client, Keyspace("pdserve"), ttl_s=30)
    for i in range(3):
        registry.register(WorkerInfo(f"m{i}", "mixed", "model", "layout", f"127.0.0.1:{40000 + i}"))
    routers = [_start_router(redis_server.url) for _ in range(2)]
    try:

        async def scenario() -> list[router_pb2.RouteResponse]:
            out = []
            for n in range(12):
                _, address = routers[n % 2]
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = router_pb2_grpc.RouterStub(channel)
                    out.append(await stub.Route(router_pb2.RouteRequest(
                        request_id=f"r{n}", prompt_token_ids=[7] * 80)))  # fmt: skip
            return out

        decisions = asyncio.run(scenario())
        counts = LoadLedger(client, Keyspace("pdserve")).snapshot("mixed").counts
        # Same prefix everywhere: bounded load spreads 12 requests as ceil(1.25*avg) allows.
        assert sum(counts.values()) == 12 and max(counts.values()) <= 5
        assert {d.decode.worker_id for d in decisions} <= {"m0", "m1", "m2"}

        async def release() -> None:
            async with grpc.aio.insecure_channel(routers[0][1]) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                ids = [i for d in decisions for i in d.load_lease_ids]
                await stub.Release(router_pb2.ReleaseLoadRequest(load_lease_ids=ids))

        asyncio.run(release())
        counts = LoadLedger(client, Keyspace("pdserve")).snapshot("mixed").counts
        assert sum(counts.values()) == 0
    finally:
        for proc, _ in routers:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=10)
        client.close()


def test_draining_decode_worker_finishes_its_stream_then_leaves() -> None:
    cluster = LocalCluster(
        ClusterConfig(
            gateway_port=0,
            num_prefill=1,
            num_decode=2,
            model_cache_dir=MODEL_CACHE,
            worker_kv_cache_bytes=96 << 20,
        )
    )
    cluster.start()
    try:
        probe = start_probe(cluster)

        async def scenario() -> tuple[list[object], str]:
            async with GatewayClient(cluster.gateway_address) as client:
                call = client.generate(
                    build_request(long_prompt(1), RequestOptions(max_tokens=60, ignore_eos=True))
                )
                msgs = []
                async for msg in call:
                    msgs.append(msg)
                    if len(msgs) == 3:
                        victim = next(c for c in cluster.children if c.name == msg.decode_worker)
                        os.kill(victim.proc.pid, signal.SIGTERM)
                return msgs, victim.name

        msgs, victim = asyncio.run(scenario())
        assert msgs[-1].finished and msgs[-1].usage.completion_tokens == 60  # type: ignore[attr-defined]
        proc = next(c for c in cluster.children if c.name == victim).proc
        proc.wait(timeout=30)

        async def after() -> tuple[set[str], list[str]]:
            async with GatewayClient(cluster.gateway_address) as client:
                end = time.monotonic() + 5
                while time.monotonic() < end:
                    status = await client.cluster_status()
                    ids = {w.worker_id for w in status.workers}
                    if victim not in ids:
                        break
                    await asyncio.sleep(0.2)
                served = []
                for _ in range(3):
                    reply = await client.complete(
                        build_request("Hello", RequestOptions(max_tokens=3))
                    )
                    served.append(reply.decode_worker)
            return ids, served

        ids, served = asyncio.run(after())
        assert victim not in ids
        assert served and all(w != victim for w in served)
        assert_cluster_clean(probe)
    finally:
        cluster.stop()

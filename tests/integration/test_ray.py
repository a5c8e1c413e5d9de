"""pdserve on a local Ray cluster: router, gateway and both worker pools as named actors.

One module-scoped cluster (the default model, KV over NIXL): generation end to end
through the gateway, `scale` at runtime, and a killed worker actor that Ray restarts,
which registers again under the same worker id and serves the next request; that test
ends with the leak probe (`leak_check`) over the workers registered in Redis.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")  # the `ray` extra (part of `test`)

from loadtest.leak_probe import LeaseTtls, ProbeTarget  # noqa: E402
from services.cluster.local_cluster import ClusterConfig  # noqa: E402
from services.gateway.client import GatewayClient, build_request  # noqa: E402
from services.ray import launcher  # noqa: E402
from services.ray.config import RayConfig  # noqa: E402
from services.ray.launcher import RayCluster, scale_pool  # noqa: E402
from services.router.keyspace import Keyspace  # noqa: E402
from services.router.redis_client import connect  # noqa: E402
from services.router.registry import Registry  # noqa: E402
from tests.conftest import MODEL_CACHE  # noqa: E402
from tests.integration.leak_check import assert_cluster_clean, start_probe  # noqa: E402

NAMESPACE = "pdserve-test"
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    # A local Ray on 127.0.0.1 only, with 4 logical CPUs and 4 custom slots to account.
    launcher.connect("", NAMESPACE, num_cpus=4, resources={"pdserve_slot": 4},
                     object_store_memory=80 << 20)  # fmt: skip
    c = RayCluster(
        ClusterConfig(num_prefill=1, num_decode=1, gateway_port=0, model_cache_dir=MODEL_CACHE,
                      worker_kv_cache_bytes=64 << 20, startup_timeout_s=180),
        RayConfig(ray_namespace=NAMESPACE, worker_cpus=1, service_cpus=0.25, max_restarts=2,
                  prefill_resources="pdserve_slot=1", decode_resources="pdserve_slot=1"),
    )  # fmt: skip
    pids: list[int] = []
    try:
        c.start()
        yield c
        status = c.status()
        pids = [status["redis_pid"], *ray.get(c.controller.pids.remote())]
    finally:
        try:
            c.stop()
        finally:
            ray.shutdown()
    # Nothing outlives the cluster: service actors, the embedded Redis.
    _until(lambda: not [p for p in pids if _alive(p)], 30, "cluster processes to exit")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _generate(address: str, max_tokens: int = 8) -> list[Any]:
    async def go() -> list[Any]:
        async with GatewayClient(address) as client:
            request = build_request(messages=[("user", QUESTION)], max_tokens=max_tokens)
            return [m async for m in client.generate(request)]

    return asyncio.run(go())


def _registered(status: dict[str, Any]) -> dict[str, str]:
    registry = Registry(connect(status["redis_url"]), Keyspace(NAMESPACE))
    return {w.worker_id: w.address for w in registry.list()}


def _workers(msgs: list[Any]) -> tuple[set[str], set[str]]:
    return {m.prefill_worker for m in msgs} - {""}, {m.decode_worker for m in msgs} - {""}


def _until(predicate: Any, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.2)


def _after_restart(call: Any, timeout_s: float = 240) -> Any:
    """`call()`, retried while Ray reports the actor as restarting."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() < end, "the actor did not come back"
            time.sleep(0.5)


async def _gateway_sees(address: str, worker_id: str, worker_address: str) -> bool:
    async with GatewayClient(address) as client:
        status = await client.cluster_status()
    return any(w.worker_id == worker_id and w.address == worker_address for w in status.workers)


def test_generation_through_the_gateway_actor(cluster: RayCluster) -> None:
    msgs = _generate(cluster.gateway_address)
    assert msgs[-1].finished
    assert _workers(msgs) == ({"prefill-0"}, {"decode-0"})
    assert sum(len(m.token_ids) for m in msgs) == 8
    status = cluster.status()
    assert status["pools"] == {"prefill": ["prefill-0"], "decode": ["decode-0"]}
    registered = _registered(status)
    assert set(registered) == {"prefill-0", "decode-0"}
    # Every service bound the node's address: loopback, for a local Ray.
    for address in [cluster.gateway_address, *registered.values()]:
        assert address.startswith("127.0.0.1:"), address
    # Resource requests: 2 workers x (1 CPU, 1 slot), gateway and router 0.25 CPU each.
    free = ray.available_resources()
    assert free["CPU"] == pytest.approx(1.5) and free["pdserve_slot"] == pytest.approx(2)


def test_killed_worker_actor_restarts_registers_again_and_serves(cluster: RayCluster) -> None:
    ttls = LeaseTtls.of(cluster.cluster)
    probe = start_probe(ProbeTarget.registry(cluster.status()["redis_url"], NAMESPACE, ttls))
    actor = ray.get_actor("pdserve-decode-0", namespace=NAMESPACE)
    old_pid = ray.get(actor.pid.remote())
    old_address = _registered(cluster.status())["decode-0"]
    ray.kill(actor, no_restart=False)  # asynchronous: the old instance may answer a while
    _until(lambda: _after_restart(lambda: ray.get(actor.pid.remote(), timeout=60)) != old_pid,
           240, "Ray to restart decode-0 in a new process")  # fmt: skip
    new_address = _after_restart(lambda: ray.get(actor.address.remote(180), timeout=240))
    assert new_address != old_address  # a new process on a new port
    _until(lambda: _registered(cluster.status()).get("decode-0") == new_address, 30,
           "decode-0 to register its new address")  # fmt: skip
    _until(lambda: asyncio.run(_gateway_sees(cluster.gateway_address, "decode-0", new_address)),
           30, "the gateway to route to the new decode-0")  # fmt: skip
    msgs = _generate(cluster.gateway_address)
    assert msgs[-1].finished and _workers(msgs) == ({"prefill-0"}, {"decode-0"})
    assert_cluster_clean(probe)


def test_scale_decode_at_runtime(cluster: RayCluster, capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli.main import main

    assert main(["scale", "decode", "2", "--ray-namespace", NAMESPACE]) == 0
    assert "decode: 2 worker(s): decode-0, decode-1" in capsys.readouterr().out
    assert set(_registered(cluster.status())) == {"prefill-0", "decode-0", "decode-1"}
    assert ray.available_resources()["pdserve_slot"] == pytest.approx(1)
    msgs = _generate(cluster.gateway_address)
    assert msgs[-1].finished
    # Scaling down drains the newest worker, which deregisters before its actor is killed.
    assert scale_pool(NAMESPACE, "decode", 1) == ["decode-0"]
    assert set(_registered(cluster.status())) == {"prefill-0", "decode-0"}
    with pytest.raises(ValueError, match="replicas"):
        scale_pool(NAMESPACE, "decode", 0)

"""pdserve on a local Ray cluster: router, gateway and both worker pools as named actors.

One module-scoped cluster (the default model, KV over NIXL): generation end to end
through the gateway, `scale` at runtime, a killed worker actor that Ray restarts, which
registers again under the same worker id and serves the next request (that test ends
with the leak probe, `leak_check`, over the workers registered in Redis), and the
autoscaler growing the prefill pool under a load step and draining it after.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")  # the `ray` extra (part of `test`)

from loadtest.reliability.leak_probe import LeaseTtls, ProbeTarget  # noqa: E402
from services.cluster.config import ClusterConfig  # noqa: E402
from services.gateway.client import GatewayClient, RequestOptions, build_request  # noqa: E402
from services.ray import launcher  # noqa: E402
from services.ray.autoscaler import AutoscaleConfig  # noqa: E402
from services.ray.config import RayConfig  # noqa: E402
from services.ray.launcher import RayCluster, scale_pool  # noqa: E402
from services.router.keyspace import Keyspace  # noqa: E402
from services.router.redis_client import connect  # noqa: E402
from services.router.registry import Registry  # noqa: E402
from tests.conftest import MODEL_CACHE  # noqa: E402
from tests.integration.leak_check import assert_cluster_clean, start_probe  # noqa: E402
from tests.prompts import long_prompt  # noqa: E402

NAMESPACE = "pdserve-test"
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    # A local Ray on 127.0.0.1 only, with 4 logical CPUs and 4 custom slots to account.
    launcher.connect("", NAMESPACE, num_cpus=4, resources={"pdserve_slot": 4},
                     object_store_memory=80 << 20)  # fmt: skip
    c = RayCluster(
        ClusterConfig(num_prefill=1, num_decode=1, gateway_port=0, model_cache_dir=MODEL_CACHE,
                      worker_kv_cache_bytes=64 << 20, startup_timeout_s=180,
                      local_prefill_max_tokens=0,  # the prefill hop, as every test cluster
                      # The autoscale drill's burst outruns one prefill worker on purpose;
                      # on a slow host its requests wait past the default 5 s budget before
                      # the second worker serves. The drill is about growing, not shedding.
                      gateway_args="--ttft-budget-standard-s 60"),
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
            request = build_request(
                messages=[("user", QUESTION)], options=RequestOptions(max_tokens=max_tokens)
            )
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


# The autoscale drill. The TTFT target sits below one long prompt's own prefill on one
# core, so a burst of them is far past what one prefill worker holds (the load step),
# while the trickle of tiny prompts after it stays under half the target (idle).
AUTOSCALE = AutoscaleConfig(
    interval_s=1.0, ttft_p90_s=0.6, queued_tokens_per_worker=10**6, itl_p90_s=30.0,
    kv_utilization=1.0, down_fraction=0.5, down_window_s=4.0, up_cooldown_s=0.0,
    down_cooldown_s=4.0, max_prefill=2, max_decode=1,
)  # fmt: skip
GROW_WITHIN_S = 90.0  # the decision (a few intervals) plus a worker's start (model load)
SHRINK_WITHIN_S = 60.0  # the low window, the cool-down, and a drain


async def _drive(address: str, prompt: str, max_tokens: int, concurrency: int,
                 until: Any, *, unique: bool = False) -> list[bool]:  # fmt: skip
    """Keep `concurrency` requests in flight until `until()`; whether each finished.
    `unique` starts each prompt with its own number, so that no request is a prefix-cache
    hit: a repeated prompt is cached where it was decoded, and conditional
    disaggregation then serves it there without a prefill (no load on the prefill pool,
    whose growth the burst is meant to cause)."""
    done: list[bool] = []
    numbers = itertools.count()

    async def one(client: GatewayClient) -> None:
        text = f"{next(numbers)}: {prompt}" if unique else prompt
        request = build_request(text, RequestOptions(max_tokens=max_tokens, ignore_eos=True))
        msgs = [m async for m in client.generate(request)]
        done.append(bool(msgs) and msgs[-1].finished)

    async def lane(client: GatewayClient) -> None:
        while not until():
            await one(client)

    async with GatewayClient(address) as client:
        await asyncio.gather(*(lane(client) for _ in range(concurrency)))
    return done


def test_autoscaling_grows_the_prefill_pool_under_load_and_drains_it_after(
    cluster: RayCluster,
) -> None:
    """A load step past one prefill worker grows the prefill pool within GROW_WITHIN_S;
    once the burst is over the pool shrinks back within SHRINK_WITHIN_S, draining the
    worker it removes; not one request fails in either direction."""
    controller = cluster.controller
    ray.get(controller.autoscale.remote(AUTOSCALE))
    try:
        start = time.monotonic()
        grown = lambda: len(cluster.status()["pools"]["prefill"]) == 2  # noqa: E731
        # Bounded: a drill that does not grow must fail, never hang.
        burst = asyncio.run(_drive(
            cluster.gateway_address, long_prompt(3), 2, 4,
            lambda: grown() or time.monotonic() - start > GROW_WITHIN_S, unique=True,
        ))  # fmt: skip
        assert grown() and time.monotonic() - start < GROW_WITHIN_S, cluster.status()
        assert cluster.status()["pools"]["decode"] == ["decode-0"]  # its signals were low
        start = time.monotonic()
        shrunk = lambda: len(cluster.status()["pools"]["prefill"]) == 1  # noqa: E731
        trickle = asyncio.run(
            _drive(cluster.gateway_address, "Hi.", 2, 1,
                   lambda: shrunk() or time.monotonic() - start > SHRINK_WITHIN_S)
        )  # fmt: skip
        assert shrunk(), cluster.status()["autoscale"]
        assert burst and trickle and all(burst) and all(trickle)
        assert cluster.status()["autoscale"]["changes"] == 2  # one growth, one shrink
        _until(lambda: set(_registered(cluster.status())) == {"prefill-0", "decode-0"}, 30,
               "the removed worker to drain and deregister")  # fmt: skip
    finally:
        ray.get(controller.autoscale.remote(None))
    assert cluster.status()["autoscale"] is None

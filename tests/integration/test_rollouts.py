"""Rollouts on real processes. One gateway serves the default model under the name
`smol` (`--extra-models`) from its worker `smol-0`; a second worker, `smol-v2-0`, serves
version v2 (`--served-model-name smol --model-version v2`), and version v3 has no worker
at all. Through the admin API (`GatewayClient.rollout`):
- v3 at 50%: its requests fail (no worker), and a gateway rolls it back automatically
  within the window; the stable version then takes everything;
- v2 at 10%: about a tenth of the requests go to `smol-v2-0` (exact binomial bounds
  that a split of 0% fails);
- promote v2 while streams run on `smol-0`: they finish, every new request goes to v2,
  and `smol-0` is draining in the registry.
Ends with the leak probe on every worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.v1 import gateway_pb2
from services.cluster.local_cluster import LocalCluster
from services.gateway.client import GatewayClient, RequestOptions, build_request
from services.router.keyspace import Keyspace, pool_namespace
from services.router.load import LoadLedger
from services.router.redis_client import connect
from services.router.registry import Registry
from tests import binomial
from tests.binomial import ALPHA
from tests.conftest import MODEL_CACHE
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.test_cluster import _cluster

MODEL = "smol"
MIN_REQUESTS = 6  # the canary requests a verdict needs here (--rollout-min-requests)
Action = gateway_pb2.RolloutAction
Ends = list[tuple[str, grpc.StatusCode]]  # per request: its decode worker, its status


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[LocalCluster]:
    # Errors decide here: the latency of a few requests on a loaded host would be noise.
    gateway = (
        f"--rollout-min-requests {MIN_REQUESTS} --rollout-refresh-s 0.2 "
        "--rollout-latency-margin 100"
    )
    c = _cluster(num_prefill=0, num_decode=1, placement="redis", http_port=-1,
                 extra_models=f"{MODEL}={model_dir}", gateway_args=gateway)  # fmt: skip
    try:
        c.add_worker(
            "smol-v2-0", "--served-model-name", MODEL, "--model-version", "v2",
            "--model", str(model_dir), "--model-cache-dir", str(MODEL_CACHE),
        )  # fmt: skip
        yield c
    finally:
        c.stop()


async def _act(
    client: GatewayClient, action: int, version: str = "", weight: float = 0.0
) -> gateway_pb2.RolloutStatus:
    request = gateway_pb2.RolloutRequest(
        model=MODEL,
        action=action,
        version=version,
        weight=weight,
    )
    return await client.rollout(request)


async def _one(client: GatewayClient, max_tokens: int = 2) -> tuple[str, grpc.StatusCode]:
    """(decode worker, status) of one request to the model."""
    request = build_request(
        "Say hi.", RequestOptions(max_tokens=max_tokens, ignore_eos=True, model=MODEL)
    )
    worker = ""
    try:
        async for msg in client.generate(request):
            worker = worker or msg.decode_worker
    except grpc.aio.AioRpcError as exc:
        return worker, exc.code()
    return worker, grpc.StatusCode.OK


def _until(done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < end, "not within the time allowed"
        time.sleep(0.1)


class _Held:
    """A long stream of the model, read to its first decode tokens, then to its end."""

    def __init__(self, client: GatewayClient) -> None:
        request = build_request(
            "Count slowly.", RequestOptions(max_tokens=48, ignore_eos=True, model=MODEL)
        )
        self.call = client.generate(request)
        self.worker = ""
        self.tokens = 0

    async def first_tokens(self) -> None:
        while self.tokens < 2:
            self._take(await self.call.read())

    def _take(self, msg: gateway_pb2.GenerateResponse) -> None:
        self.worker = self.worker or msg.decode_worker
        self.tokens += len(msg.token_ids)

    async def finish(self) -> tuple[str, grpc.StatusCode]:
        try:
            while (msg := await self.call.read()) is not grpc.aio.EOF:
                self._take(msg)
        except grpc.aio.AioRpcError as exc:
            return self.worker, exc.code()
        return self.worker, grpc.StatusCode.OK


async def _many(client: GatewayClient, n: int) -> Ends:
    out: Ends = []
    for start in range(0, n, 8):  # 8 at a time: quick, without queueing past deadlines
        out += await asyncio.gather(*(_one(client) for _ in range(min(8, n - start))))
    return out


def test_a_failing_version_is_rolled_back_automatically(cluster: LocalCluster) -> None:
    async def scenario() -> gateway_pb2.RolloutStatus:
        async with GatewayClient(cluster.gateway_address) as client:
            await _act(client, Action.ROLLOUT_ACTION_START, "v3", 0.5)
            end = time.monotonic() + 30.0
            while True:
                await _many(client, 8)
                status = await _act(client, Action.ROLLOUT_ACTION_STATUS)
                if status.phase != "running" or time.monotonic() > end:
                    break
            after = await _many(client, 8)
        assert {w for w, _ in after} == {"smol-0"}  # the stable version takes all again
        assert {code for _, code in after} == {grpc.StatusCode.OK}
        return status

    status = asyncio.run(scenario())
    assert status.phase == "rolled_back", status
    assert status.reason.startswith("automatic: error rate")
    assert status.canary_window.errors >= MIN_REQUESTS


def test_a_canary_takes_its_share_and_promote_drains_the_old_version(
    cluster: LocalCluster,
) -> None:
    probe = start_probe(cluster)
    # Exact binomial bounds at 10%: (1, 35) of 144. A right split falls outside them with
    # probability 4.5e-7; a split of 0% never lands inside. Telling 10% from 20% takes
    # about 1200 requests (0.92 of 20% splits land inside these bounds): the unit tests
    # do that (tests/unit/services/test_rollouts.py, test_rollout_follower.py).
    n, weight = 144, 0.1
    within = binomial.bounds(n, weight)
    assert binomial.accepts(n, 0.0, within) < ALPHA

    async def scenario() -> tuple[Ends, Ends, Ends]:
        async with GatewayClient(cluster.gateway_address) as client:
            status = await _act(client, Action.ROLLOUT_ACTION_START, "v2", weight)
            assert (status.phase, status.canary, status.weight) == ("running", "v2", weight)
            split = await _many(client, n)
            # Streams on the stable version (no rollout runs) when v2 is promoted.
            await _act(client, Action.ROLLOUT_ACTION_ABORT)
            running = [_Held(client) for _ in range(3)]
            await asyncio.gather(*(h.first_tokens() for h in running))
            await _act(client, Action.ROLLOUT_ACTION_START, "v2", weight)
            status = await _act(client, Action.ROLLOUT_ACTION_PROMOTE)
            assert (status.phase, status.stable) == ("promoted", "v2")
            after = await _many(client, 8)
            ended = await asyncio.gather(*(h.finish() for h in running))
            assert all(h.tokens == 48 for h in running)
            return split, list(ended), after

    split, running, after = asyncio.run(scenario())
    assert {code for _, code in split + running + after} == {grpc.StatusCode.OK}
    canary = sum(1 for w, _ in split if w == "smol-v2-0")
    assert {w for w, _ in split} <= {"smol-0", "smol-v2-0"}
    assert within[0] <= canary <= within[1], (canary, within)
    assert {w for w, _ in running} == {"smol-0"}  # finished where they started
    assert {w for w, _ in after} == {"smol-v2-0"}
    assert cluster.redis is not None
    client = connect(cluster.redis.url, 2.0)
    pools = {v: Keyspace(pool_namespace("pdserve", MODEL, v)) for v in ("", "v2", "v3")}
    # The old version drains once every gateway has had time to follow the promote.
    old = Registry(client, pools[""])
    _until(lambda: [(w.worker_id, w.draining) for w in old.list()] == [("smol-0", True)])
    assert_cluster_clean(probe)  # every worker's blocks and leases, the base pools' load
    for pool in pools.values():  # and the model's own pools' load
        ledger = LoadLedger(client, pool)
        _until(lambda ledger=ledger: ledger.snapshot("mixed").counts == {})

"""Admission on inter-token latency through real processes: a stream waits while the
decode step it would join is predicted past its class's share of the ITL budget, is
refused at its TTFT budget with a retry hint naming the decode step, and is served once
the decode worker is idle; the cluster is left clean.

One cluster (1 prefill + 1 decode worker, embedded Redis) runs with an ITL budget of
1 ms, which no measured decode step meets: a decode worker with a stream on it is always
"full", an idle one always takes a stream (however slow), and before any step time is
measured admission fails open.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from pdserve.v1 import common_pb2, gateway_pb2
from services.cluster.local_cluster import LocalCluster
from services.common.metrics import scrape
from services.gateway.client import GatewayClient, RequestOptions, build_request
from tests.integration.keyed_cluster import keyed_cluster
from tests.integration.leak_check import assert_cluster_clean, start_probe

# Runs beside one other pairable file in make test (tests/conftest.py).
pytestmark = pytest.mark.pairable

KEY = "tenant-itl-key-00000000001"
SHEDDABLE_BUDGET_S = 1.0
GATEWAY_ENV = {
    "PDSERVE_ITL_BUDGET_S": "0.001",
    "PDSERVE_TTFT_BUDGET_SHEDDABLE_S": str(SHEDDABLE_BUDGET_S),
    "PDSERVE_TTFT_BUDGET_CRITICAL_S": "30",
}
SIGNALS_S = 0.8  # a few signal publishes (every 0.25 s) and admission reads
PREDICTED = "pdserve_gateway_decode_step_predicted_seconds"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from keyed_cluster(tmp_path_factory, f"itl {KEY} max_class=critical\n", GATEWAY_ENV)


def _request(
    prompt: str, max_tokens: int, priority: common_pb2.Priority
) -> gateway_pb2.GenerateRequest:
    request = build_request(prompt, RequestOptions(max_tokens=max_tokens, ignore_eos=True))
    request.priority = priority
    return request


async def _scenario(cluster: LocalCluster) -> tuple[grpc.aio.AioRpcError, float, bool]:
    async with GatewayClient(cluster.gateway_address, api_key=KEY) as client:
        for i in range(2):  # the decode worker measures its step times
            warm = _request(f"Warm up {i}: count.", 16, common_pb2.PRIORITY_CRITICAL)
            await client.complete(warm)
        await asyncio.sleep(SIGNALS_S)
        long = client.generate(_request("Count slowly.", 400, common_pb2.PRIORITY_CRITICAL))
        for _ in range(3):
            await long.read()  # it decodes on the decode worker
        await asyncio.sleep(SIGNALS_S)  # its signal shows the stream
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.complete(_request("hi", 2, common_pb2.PRIORITY_SHEDDABLE))
        waited = time.monotonic() - start
        long.cancel()
        await asyncio.sleep(SIGNALS_S)  # the decode worker is idle again
        served = await client.complete(_request("hi", 2, common_pb2.PRIORITY_SHEDDABLE))
        return refused.value, waited, served.finished


def test_a_full_decode_worker_holds_a_stream_and_an_idle_one_takes_it(
    cluster: LocalCluster,
) -> None:
    probe = start_probe(cluster)
    error, waited, served = asyncio.run(_scenario(cluster))
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert "decode step it would join is predicted at" in (error.details() or ""), error
    assert int(dict(error.trailing_metadata() or ())["retry-after-ms"]) >= 1000
    assert SHEDDABLE_BUDGET_S <= waited < SHEDDABLE_BUDGET_S + 0.6  # it waited its budget
    assert served
    port = cluster.gateways[0].metrics_port
    assert port is not None
    assert scrape(port)[PREDICTED] > 0.001  # the step a new stream would join, measured
    assert_cluster_clean(probe)

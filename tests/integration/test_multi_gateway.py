"""A local cluster with two gateway replicas: both serve, both get the extra gateway
flags, they share the workers and Redis, the leak probe reads both, and `stop()` stops
every process."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from loadtest.flow.cluster import probe_targets
from loadtest.reliability.leak_probe import LeakProbe
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from services.gateway.client import GatewayClient, RequestOptions, build_request
from tests.conftest import MODEL_CACHE

# Runs beside one other pairable file in make test (tests/conftest.py).
pytestmark = pytest.mark.pairable

LIMIT = 24  # --max-tokens-limit given through gateway_args


async def _tokens(address: str, max_tokens: int) -> int:
    async with GatewayClient(address) as client:
        request = build_request(
            "Name a river.", RequestOptions(max_tokens=max_tokens, ignore_eos=True)
        )
        return sum([len(m.token_ids) async for m in client.generate(request, timeout=60)])


async def _serve_and_probe(cluster: LocalCluster) -> None:
    probes = [await LeakProbe.start(t) for t in probe_targets(cluster)]
    for address in cluster.gateway_addresses:
        assert await _tokens(address, 4) == 4
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _tokens(address, LIMIT + 1)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for probe in probes:
        leaks = await probe.wait_clean()
        assert leaks.clean, leaks


def test_two_gateways_share_the_workers() -> None:
    cfg = ClusterConfig(gateway_port=0, gateways=2, model_cache_dir=MODEL_CACHE,
                        worker_kv_cache_bytes=96 << 20,
                        gateway_args=f"--max-tokens-limit {LIMIT}")  # fmt: skip
    cluster = LocalCluster(cfg)
    cluster.start()
    try:
        assert [c.name for c in cluster.gateways] == ["gateway", "gateway-1"]
        assert [c.name for c in cluster.workers] == ["prefill-0", "decode-0"]
        addresses = cluster.gateway_addresses
        assert len(set(addresses)) == 2 and cluster.gateway_address == addresses[0]
        assert len(set(cluster.http_addresses)) == 2 and all(cluster.http_addresses)
        asyncio.run(_serve_and_probe(cluster))
    finally:
        procs = [c.proc for c in cluster.children]
        cluster.stop()
    assert all(p.poll() is not None for p in procs)


def test_bad_gateway_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="gateways"):
        ClusterConfig(gateways=0)
    with pytest.raises(ValueError, match="gateway_args"):
        ClusterConfig(gateway_args="--flag 'unclosed")

"""Auth, tenants, quotas and mutual TLS through real processes on 127.0.0.1.

One cluster (1 prefill + 1 decode, embedded Redis) runs with mutual TLS on every gRPC
hop (client → gateway → workers, and the decode worker's KV reads from the prefill
worker over the TCP backend, so the KV bytes cross TLS too), HTTPS on the OpenAI API,
and an API keys file with three tenants and an admin. Every test that is refused ends
with the leak probe (`leak_check`, over the same mutual TLS); the quota test also checks
that the tenant's window was charged exactly the tokens its request used.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import openai
import pytest

from engine.model_store import DEFAULT_MODEL_NAME
from pdserve.v1 import gateway_pb2
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from services.common.tls import TlsConfig
from services.gateway.client import GatewayClient, RequestOptions, build_request
from tests.certs import TestCA
from tests.conftest import MODEL_CACHE
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.pins import Pin
from tests.prompts import long_prompt

# Runs beside one other pairable file in make test (tests/conftest.py).
# Pins (tests/integration/pins.py): a tenant's repeated prompt must be served where its
# first one cached the prefix; at the default threshold the gateway may prefill the first
# on the prefill worker and the repeat on the decode worker.
pytestmark = [pytest.mark.pairable, pytest.mark.pins(Pin.PREFILL_HOP)]

KEY_A = "tenant-a-key-000000000001"
KEY_B = "tenant-b-key-000000000002"
KEY_C = "tenant-c-key-000000000003"
KEY_ADMIN = "ops-admin-key-00000000004"
TPM_C = 50


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[TlsConfig, TlsConfig]:
    """(the cluster's TLS settings, a client's); one CA signs both."""
    directory = tmp_path_factory.mktemp("pki")
    ca = TestCA(directory)
    server, client = ca.issue("pdserve"), ca.issue("client")
    serve = TlsConfig(str(server.cert), str(server.key), str(ca.ca_file), tls_client_auth=True)
    dial = TlsConfig(str(client.cert), str(client.key), str(ca.ca_file), tls_client_auth=True)
    return serve, dial


@pytest.fixture(scope="module")
def cluster(
    pki: tuple[TlsConfig, TlsConfig], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    keys = tmp_path_factory.mktemp("auth") / "keys"
    keys.write_text(
        f"tenant-a {KEY_A}\ntenant-b {KEY_B}\ntenant-c {KEY_C} tpm={TPM_C}\nops {KEY_ADMIN} admin\n"
    )
    cfg = ClusterConfig(
        gateway_port=0, model_cache_dir=MODEL_CACHE, worker_kv_cache_bytes=96 << 20,
        kv_backend="tcp", api_keys_file=str(keys),
    )  # fmt: skip
    c = LocalCluster(cfg, tls=pki[0])
    c.start()
    yield c
    c.stop()


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def _client(cluster: LocalCluster, pki: tuple[TlsConfig, TlsConfig], key: str) -> GatewayClient:
    return GatewayClient(cluster.gateway_address, api_key=key, tls=pki[1])


async def _final(client: Callable[[], GatewayClient], prompt: str, max_tokens: int = 4) -> object:
    """The last message of a completion; the client is built inside the running loop."""
    request = build_request(prompt, RequestOptions(max_tokens=max_tokens))
    async with client() as client:
        msgs = [m async for m in client.generate(request)]
    return msgs[-1]


def test_mutual_tls_every_hop(cluster: LocalCluster, pki: tuple[TlsConfig, TlsConfig]) -> None:
    probe = start_probe(cluster)
    last = run(_final(lambda: _client(cluster, pki, KEY_A), "Name three colours."))
    assert last.finished and last.usage.completion_tokens == 4  # type: ignore[attr-defined]
    for tls in (TlsConfig(), TlsConfig(tls_ca=pki[1].tls_ca)):  # plaintext; TLS without a cert
        with pytest.raises(grpc.aio.AioRpcError) as err:
            run(
                _final(
                    lambda t=tls: GatewayClient(cluster.gateway_address, api_key=KEY_A, tls=t), "hi"
                )
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert_cluster_clean(probe)


@pytest.mark.parametrize("key", ["", "not-a-real-key-0000000000"])
def test_missing_or_wrong_key_is_unauthenticated(
    cluster: LocalCluster, pki: tuple[TlsConfig, TlsConfig], key: str
) -> None:
    probe = start_probe(cluster)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(_final(lambda: _client(cluster, pki, key), "hi"))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "API key" in (err.value.details() or "")
    assert_cluster_clean(probe)


def test_cluster_status_needs_an_admin_key(
    cluster: LocalCluster, pki: tuple[TlsConfig, TlsConfig]
) -> None:
    probe = start_probe(cluster)

    async def status(key: str) -> object:
        async with _client(cluster, pki, key) as client:
            return await client.cluster_status()

    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(status(KEY_A))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert len(run(status(KEY_ADMIN)).workers) == 2  # type: ignore[attr-defined]
    assert_cluster_clean(probe)


def test_tenants_never_share_prefix_cache_hits(
    cluster: LocalCluster, pki: tuple[TlsConfig, TlsConfig]
) -> None:
    probe = start_probe(cluster)
    prompt = long_prompt(1)[:600]  # several full KV blocks
    first_a = run(_final(lambda: _client(cluster, pki, KEY_A), prompt))
    again_a = run(_final(lambda: _client(cluster, pki, KEY_A), prompt))
    first_b = run(_final(lambda: _client(cluster, pki, KEY_B), prompt))
    again_b = run(_final(lambda: _client(cluster, pki, KEY_B), prompt))
    assert first_a.usage.cached_tokens == 0  # type: ignore[attr-defined]
    assert again_a.usage.cached_tokens >= 16  # type: ignore[attr-defined]
    assert first_b.usage.cached_tokens == 0  # B never hits A's blocks...  # type: ignore[attr-defined]
    assert again_b.usage.cached_tokens >= 16  # ...but does hit its own  # type: ignore[attr-defined]
    assert_cluster_clean(probe)


def test_quota_refuses_with_a_retry_hint(
    cluster: LocalCluster, pki: tuple[TlsConfig, TlsConfig]
) -> None:
    probe = start_probe(cluster)

    async def scenario() -> tuple[grpc.aio.AioRpcError, gateway_pb2.GenerateResponse]:
        async with _client(cluster, pki, KEY_C) as holder, _client(cluster, pki, KEY_C) as other:
            # Charged prompt + max_tokens > TPM_C while it streams: the next is refused.
            call = holder.generate(build_request("Count to fifty.", RequestOptions(max_tokens=60)))
            await anext(aiter(call))
            try:
                await other.complete(build_request("hi", RequestOptions(max_tokens=2)))
            except grpc.aio.AioRpcError as exc:
                refused = exc
            else:
                call.cancel()
                raise AssertionError("the second request was admitted")
            last = [m async for m in call][-1]  # the holder finishes: its unused part is refunded
        return refused, last

    err, last = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tokens_per_minute" in (err.details() or "")
    hint = dict(err.trailing_metadata() or ())
    assert 0 < int(hint["retry-after-ms"]) <= 60_000
    # Other tenants are not affected.
    assert run(_final(lambda: _client(cluster, pki, KEY_B), "hi", 2)).finished  # type: ignore[attr-defined]
    # Tenant C's window holds exactly what its one admitted request used; nobody else's
    # (tenants A and B are unmetered) holds anything.
    assert last.finished and last.usage.completion_tokens < 60
    used = last.usage.prompt_tokens + last.usage.completion_tokens
    assert_cluster_clean(probe, quota_used={"tenant-c": used})


def test_https_openai_api_with_keys(
    cluster: LocalCluster, pki: tuple[TlsConfig, TlsConfig], tmp_path: Path
) -> None:
    probe = start_probe(cluster)
    tls = pki[1]
    context = ssl.create_default_context(cafile=tls.tls_ca)
    context.load_cert_chain(tls.tls_cert, tls.tls_key)  # mutual TLS: the client's certificate
    http = openai.DefaultHttpx2Client(verify=context)
    base = f"https://{cluster.http_address}/v1"
    good = openai.OpenAI(base_url=base, api_key=KEY_A, http_client=http, max_retries=0)
    reply = good.completions.create(
        model=DEFAULT_MODEL_NAME, prompt="Say hi.", max_tokens=3, temperature=0
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    bad = openai.OpenAI(base_url=base, api_key="wrong-key-000000000000", http_client=http,
                        max_retries=0)  # fmt: skip
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=DEFAULT_MODEL_NAME, prompt="Say hi.", max_tokens=3)
    assert_cluster_clean(probe)

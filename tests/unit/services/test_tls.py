"""TLS and mutual TLS on a real gRPC server with certificates made by the test."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import CHANNEL_OPTIONS, build_server
from services.common.tls import TlsConfig, open_aio_channel
from tests.certs import TestCA


async def _check(address: str, cfg: TlsConfig) -> int:
    async with open_aio_channel(address, cfg, CHANNEL_OPTIONS) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        return int(reply.status)


async def _serve_and_probe(server_cfg: TlsConfig, client_cfg: TlsConfig) -> int:
    built = build_server("127.0.0.1", 0, [], tls=server_cfg)
    await built.server.start()
    await built.mark_serving()
    try:
        return await _check(f"127.0.0.1:{built.port}", client_cfg)
    finally:
        await built.server.stop(None)


def _cfg(ca: TestCA, stem: str | None, **kw: object) -> TlsConfig:
    files = ca.issue(stem) if stem else None
    return TlsConfig(
        tls_cert=str(files.cert) if files else "", tls_key=str(files.key) if files else "",
        tls_ca=str(ca.ca_file), **kw,  # type: ignore[arg-type]
    )  # fmt: skip


SERVING = health_pb2.HealthCheckResponse.SERVING


def test_tls_and_mutual_tls(tmp_path: Path) -> None:
    ca = TestCA(tmp_path)
    server = _cfg(ca, "server")
    assert asyncio.run(_serve_and_probe(server, _cfg(ca, None))) == SERVING
    mtls = _cfg(ca, "server-m", tls_client_auth=True)
    assert asyncio.run(_serve_and_probe(mtls, _cfg(ca, "client", tls_client_auth=True))) == SERVING


def test_refusals(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ca, other = TestCA(tmp_path / "a"), TestCA(tmp_path / "b", "other CA")
    server = _cfg(ca, "server")
    mtls = _cfg(ca, "server-m", tls_client_auth=True)
    for server_cfg, client_cfg in [
        (server, TlsConfig()),  # plaintext client, TLS server
        (server, _cfg(other, None)),  # server cert from a CA the client does not trust
        (mtls, _cfg(ca, None)),  # mutual TLS server, client without a certificate
        (mtls, _cfg(other, "intruder", tls_client_auth=True)),  # client cert from another CA
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(_serve_and_probe(server_cfg, client_cfg))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_config_is_checked_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="both or neither"):
        TlsConfig(tls_cert=str(tmp_path))
    with pytest.raises(ValueError, match="no such file"):
        TlsConfig(tls_cert=str(tmp_path / "nope"), tls_key=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="tls_client_auth"):
        TlsConfig(tls_client_auth=True)

"""The gateway's side of finish reasons: a request that ends on max_tokens reports
`length` on every path (gRPC Generate and Complete, HTTP completions and chat, streamed
and not), whether it ends on the decode worker or already on the prefill worker (one
token); a stop passes through as `stop`. Workers are fakes that end with the reason
under test; the gateway (gRPC server, HTTP API, Redis placement) is real. Each case ends
with the leak check."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import redis

from pdserve.v1 import common_pb2, gateway_pb2_grpc
from services.gateway.client import RequestOptions, build_request
from services.gateway.openai.http_api import HttpApi
from services.gateway.stream.record_book import Resource
from services.gateway.wire import add_servicer
from tests.unit.services.gateway_fakes import Gateway, build_gateway

REASONS = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_STOP: "stop"}


class Front:
    """Both front doors of one gateway."""

    def __init__(self, gw: Gateway, grpc_target: str, http_base: str) -> None:
        self.gw = gw
        self.stub = gateway_pb2_grpc.GatewayStub(grpc.aio.insecure_channel(grpc_target))
        self.http_base = http_base

    async def grpc_paths(self, max_tokens: int) -> dict[str, int]:
        req = build_request("hi there", RequestOptions(max_tokens=max_tokens))
        streamed = [msg async for msg in self.stub.Generate(req)]
        assert streamed[-1].finished and not any(m.finished for m in streamed[:-1])
        whole = await self.stub.Complete(req)
        assert whole.finished and whole.usage.completion_tokens == max_tokens
        return {"grpc_stream": streamed[-1].finish_reason, "grpc_complete": whole.finish_reason}

    async def http_paths(self, max_tokens: int) -> dict[str, str]:
        reasons: dict[str, str] = {}
        async with aiohttp.ClientSession() as http:
            for route, body in (
                ("completions", {"prompt": "hi there"}),
                ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ):
                for stream in (False, True):
                    sent = {**body, "model": "m", "max_tokens": max_tokens, "stream": stream}
                    url = f"{self.http_base}/{route}"
                    async with http.post(url, json=sent) as response:
                        assert response.status == 200, await response.text()
                        reason = await (_sse_reason(response) if stream else _reason(response))
                    reasons[f"http_{route.split('/')[0]}_{'stream' if stream else 'whole'}"] = (
                        reason
                    )
        return reasons


async def _reason(response: aiohttp.ClientResponse) -> str:
    body: dict[str, Any] = await response.json()
    reason = body["choices"][0]["finish_reason"]
    assert isinstance(reason, str)
    return reason


async def _sse_reason(response: aiohttp.ClientResponse) -> str:
    """The finish reason of the one chunk that has one (every other chunk has null)."""
    reasons: list[str] = []
    async for line in response.content:
        text = line.decode().strip()
        if not text.startswith("data: ") or text == "data: [DONE]":
            continue
        chunk = json.loads(text.removeprefix("data: "))
        assert "error" not in chunk, chunk
        reasons += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]]
    assert len(reasons) == 1, reasons
    return reasons[0]


@contextlib.asynccontextmanager
async def _serve(gw: Gateway) -> AsyncIterator[Front]:
    server = grpc.aio.server()
    add_servicer(gateway_pb2_grpc.add_GatewayServicer_to_server, gw.service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    api = HttpApi(gw.service, drain_s=1.0)
    address = await api.start("127.0.0.1", 0)
    try:
        yield Front(gw, f"127.0.0.1:{port}", f"http://{address}/v1")
    finally:
        await api.stop()
        await server.stop(grace=1.0)
        await gw.service.close()


@pytest.mark.parametrize("reason", list(REASONS), ids=list(REASONS.values()))
@pytest.mark.parametrize("max_tokens", [4, 1], ids=["ends_in_decode", "ends_in_prefill"])
def test_finish_reason_on_every_path(
    client: redis.Redis, model_dir: Path, max_tokens: int, reason: int
) -> None:
    async def scenario() -> None:
        gw = build_gateway(client, f"fr-{uuid.uuid4().hex[:12]}", model_dir)
        gw.cluster.finish_reason = reason
        async with _serve(gw) as front:
            grpc_reasons = await front.grpc_paths(max_tokens)
            http_reasons = await front.http_paths(max_tokens)
            assert grpc_reasons == dict.fromkeys(grpc_reasons, reason)
            assert http_reasons == dict.fromkeys(http_reasons, REASONS[reason])
            assert len(http_reasons) == 4
        # The leak check: every request gave everything back.
        assert gw.service.book.counts() == dict.fromkeys(Resource, 0)
        assert gw.load_counts() == {"prefill": {}, "decode": {}}
        assert gw.cluster.leaks() == []
        # One token from prefill ends there: no decode call at all.
        assert (gw.cluster.decodes == []) == (max_tokens == 1)

    asyncio.run(scenario())

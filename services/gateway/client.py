"""The async Python client of the gateway, used by the CLI, the tests and the load tester.

Lifecycle: `build_request(prompt, RequestOptions(...))` makes a request (a chat one:
`build_request(messages=..., options=...)`); `async with GatewayClient(address) as
client:` opens one channel; `generate` returns the live streaming call (iterate it for
deltas; `call.cancel()` or leaving the iteration early cancels the request everywhere);
`complete` returns the whole answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

import grpc

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.tls import TlsConfig, open_aio_channel


@dataclass(frozen=True)
class RequestOptions:
    """What a request asks for besides its input: sampling (None: the server's default),
    the model it names ("": the gateway's primary) and its id ("": one is made)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    model: str = ""
    request_id: str = ""


def build_request(
    prompt: str | None = None,
    options: RequestOptions = RequestOptions(),
    *,
    messages: Sequence[tuple[str, str]] | None = None,
) -> gateway_pb2.GenerateRequest:
    """A GenerateRequest from plain values; exactly one of prompt/messages."""
    o = options
    sp = common_pb2.SamplingParams(stop=list(o.stop), ignore_eos=o.ignore_eos)
    for name, value in (("max_tokens", o.max_tokens), ("temperature", o.temperature),
                        ("top_p", o.top_p), ("top_k", o.top_k), ("seed", o.seed)):  # fmt: skip
        if value is not None:
            setattr(sp, name, value)
    req = gateway_pb2.GenerateRequest(model=o.model, sampling=sp, request_id=o.request_id)
    if messages is not None:
        req.messages.messages.extend(
            gateway_pb2.ChatMessage(role=r, content=c) for r, c in messages
        )
    elif prompt is not None:
        req.prompt = prompt
    return req


@dataclass(frozen=True)
class ClientConfig:
    api_key: str = field(
        default="",
        metadata={"help": "API key, sent as 'authorization: Bearer' (prefer the env var)"},
    )


class GatewayClient:
    """`api_key` is sent as `authorization: Bearer <key>` on every call; `tls` verifies
    the gateway (and presents a client certificate under mutual TLS)."""

    def __init__(self, address: str, *, api_key: str = "", tls: TlsConfig | None = None) -> None:
        self.address = address
        self._channel = open_aio_channel(address, tls or TlsConfig(), CHANNEL_OPTIONS)
        self.stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def generate(
        self, request: gateway_pb2.GenerateRequest, *, timeout: float | None = None
    ) -> grpc.aio.UnaryStreamCall:
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    async def complete(
        self, request: gateway_pb2.GenerateRequest, *, timeout: float | None = None
    ) -> gateway_pb2.GenerateResponse:
        response: gateway_pb2.GenerateResponse = await self.stub.Complete(
            request, timeout=timeout, metadata=self.metadata
        )
        return response

    async def list_models(self) -> gateway_pb2.ListModelsResponse:
        response: gateway_pb2.ListModelsResponse = await self.stub.ListModels(
            gateway_pb2.ListModelsRequest(), metadata=self.metadata
        )
        return response

    async def rollout(self, request: gateway_pb2.RolloutRequest) -> gateway_pb2.RolloutStatus:
        """Start, promote, abort or read a model's rollout (an admin key's call)."""
        response: gateway_pb2.RolloutStatus = await self.stub.Rollout(
            request, metadata=self.metadata
        )
        return response

    async def cluster_status(self) -> gateway_pb2.ClusterStatusResponse:
        response: gateway_pb2.ClusterStatusResponse = await self.stub.ClusterStatus(
            gateway_pb2.ClusterStatusRequest(), metadata=self.metadata
        )
        return response

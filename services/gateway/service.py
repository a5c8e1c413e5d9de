"""The Gateway gRPC service: validation, tokenization, the stream cap, and streaming.

Lifecycle of a call: check the model name and the input, tokenize (chat template for a
message list), validate sampling against the context length, take a stream slot (or
fail fast with RESOURCE_EXHAUSTED), then relay a `RequestStream`. Typed errors become
gRPC statuses naming the field; the slot is always given back.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc

from engine.errors import InvalidRequestError
from engine.tokenizer import ChatMessage, Tokenizer
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common import sampling
from services.common.detokenizer import IncrementalDetokenizer
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.status import status_for
from services.gateway.config import GatewayConfig
from services.gateway.request_stream import Prepared, RequestStream, StreamError
from services.router.placement import NoWorkerError, Placement

MAX_PROMPT_CHARS = 1_000_000


class WorkerStubs:
    """One channel per worker address, opened on first use (membership changes)."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}

    def __getitem__(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()


class GatewayService(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        config: GatewayConfig,
        placement: Placement,
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.config = config
        self.placement = placement
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.active = 0
        self.stubs = WorkerStubs()

    async def close(self) -> None:
        await self.stubs.close()

    # -- validation --------------------------------------------------------------
    def prepare(self, request: gateway_pb2.GenerateRequest) -> Prepared:
        if request.model and request.model != self.model_name:
            raise LookupError(
                f"model: {request.model!r} is not served here (serving {self.model_name!r})"
            )
        params = sampling.from_proto(request.sampling)
        prompt = self._tokens(request)
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"has {len(prompt)} tokens; must be < {self.max_model_len}"
            )
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "sampling.max_tokens",
                f"prompt ({len(prompt)}) + max_tokens must be <= {self.max_model_len}",
                params.max_tokens,
            )
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError(
                "sampling.stop_token_ids", f"each id must be < {self.vocab_size}"
            )
        return Prepared(request.request_id or uuid.uuid4().hex, prompt, params, tenant="")

    def _tokens(self, request: gateway_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("input")
        if which == "prompt":
            if len(request.prompt) > MAX_PROMPT_CHARS:
                raise InvalidRequestError("prompt", f"at most {MAX_PROMPT_CHARS} characters")
            return self.tokenizer.encode(request.prompt)
        if which == "messages":
            msgs = [ChatMessage(m.role, m.content) for m in request.messages.messages]
            if sum(len(m.content) for m in msgs) > MAX_PROMPT_CHARS:
                raise InvalidRequestError(
                    "messages", f"at most {MAX_PROMPT_CHARS} characters in all"
                )
            return self.tokenizer.encode_chat(msgs)
        raise InvalidRequestError("input", "set prompt or messages")

    # -- RPCs --------------------------------------------------------------------
    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        prepared = await self._prepare_or_abort(request, context)
        if self.active >= self.config.max_streams:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"max_streams: {self.config.max_streams} streams already running; retry later",
            )
        self.active += 1
        stream = RequestStream(
            prepared,
            self.config,
            self.placement,
            self.stubs,
            IncrementalDetokenizer(self.tokenizer),
        )
        try:
            async for msg in stream.run():
                yield msg
        except (StreamError, NoWorkerError) as exc:
            await context.abort(exc.code, str(exc))
        finally:
            self.active -= 1

    async def Complete(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GenerateResponse:
        whole = gateway_pb2.GenerateResponse()
        async for msg in self.Generate(request, context):
            whole.request_id = msg.request_id
            whole.text += msg.text
            whole.token_ids.extend(msg.token_ids)
            whole.prefill_worker = whole.prefill_worker or msg.prefill_worker
            whole.decode_worker = whole.decode_worker or msg.decode_worker
            if msg.finished:
                whole.finished, whole.finish_reason = True, msg.finish_reason
                whole.usage.CopyFrom(msg.usage)
        return whole

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        return gateway_pb2.ListModelsResponse(
            models=[gateway_pb2.ModelInfo(id=self.model_name, max_model_len=self.max_model_len)]
        )

    async def ClusterStatus(
        self, request: gateway_pb2.ClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ClusterStatusResponse:
        reply = gateway_pb2.ClusterStatusResponse(
            active_streams=self.active, max_streams=self.config.max_streams
        )
        for ref in self.placement.workers():
            try:
                stats = await self.stubs[ref.address].Stats(worker_pb2.StatsRequest(), timeout=2.0)
            except grpc.aio.AioRpcError as exc:
                stats = worker_pb2.WorkerStats(
                    worker_id=ref.worker_id,
                    role=f"unreachable: {exc.code().name}",
                    address=ref.address,
                )
            reply.workers.append(stats)
        return reply

    async def _prepare_or_abort(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> Prepared:
        try:
            return self.prepare(request)
        except LookupError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except InvalidRequestError as exc:
            code, message = status_for(exc)
            await context.abort(code, message)
        raise AssertionError("unreachable")

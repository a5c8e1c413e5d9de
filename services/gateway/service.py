"""The Gateway gRPC service: validation, tokenization, the stream cap, and streaming.

Lifecycle of a call: check the model name and the input, tokenize (chat template for a
message list), validate sampling against the context length, take a stream slot (or
fail fast with RESOURCE_EXHAUSTED), then relay a `RequestStream`. Typed errors become
gRPC statuses naming the field; the slot is always given back.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Coroutine
from dataclasses import replace
from typing import Any

import grpc

from engine.errors import InvalidRequestError
from engine.tokenizer import ChatMessage, Tokenizer
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common import sampling
from services.common.detached import Detached
from services.common.detokenizer import IncrementalDetokenizer
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.status import status_for
from services.common.tls import TlsConfig, open_aio_channel
from services.gateway.access import Access
from services.gateway.auth import ANONYMOUS, AuthError, Principal
from services.gateway.config import GatewayConfig
from services.gateway.quota import QuotaExceeded
from services.gateway.request_stream import Prepared, RequestStream, StreamError
from services.gateway.stream_telemetry import GatewayTelemetry
from services.router.placement import NoWorkerError, Placement

MAX_PROMPT_CHARS = 1_000_000
CLEANUP_GRACE_S = 3.0  # at shutdown: request cleanups still running (an Abort is <= 2 s)


class UnknownModelError(LookupError):
    """The request names a model this gateway does not serve (NOT_FOUND, HTTP 404)."""


class WorkerStubs:
    """One channel per worker address, opened on first use (membership changes), and the
    work on workers that outlives a request's task: reads left to finish (`linger`) and
    cleanups run to their end (`finish`)."""

    def __init__(self, tls: TlsConfig | None = None) -> None:
        self.tls = tls or TlsConfig()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._lingering: set[asyncio.Future[Any]] = set()
        self._detached = Detached()

    def __getitem__(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = open_aio_channel(address, self.tls, CHANNEL_OPTIONS)
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    def linger(self, read: asyncio.Future[Any], call: grpc.aio.Call) -> None:
        """Keep a read whose reader left alive until it ends, then cancel its call
        (`RequestStream._decode` says why). Held here: the loop keeps only weak references
        to tasks."""
        self._lingering.add(read)

        def done(future: asyncio.Future[Any]) -> None:
            self._lingering.discard(future)
            if not future.cancelled():
                future.exception()  # retrieved: the stream it belonged to is gone
            call.cancel()

        read.add_done_callback(done)

    def finish(self, work: Coroutine[Any, Any, None]) -> Awaitable[None]:
        """Run a request's cleanup to its end however its task ends (`Detached`)."""
        return self._detached.finish(work)

    async def close(self) -> None:
        for read in list(self._lingering):
            read.cancel()
        await self._detached.close(CLEANUP_GRACE_S)  # their Abort calls need the channels
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
        telemetry: GatewayTelemetry | None = None,
        access: Access | None = None,
        stubs: WorkerStubs | None = None,
    ) -> None:
        self.config = config
        self.access = access or Access.open()
        self.telemetry = telemetry or GatewayTelemetry.disabled()
        self.placement = placement
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.active = 0
        self.stubs = stubs or WorkerStubs()

    async def close(self) -> None:
        await self.stubs.close()

    # -- validation --------------------------------------------------------------
    def prepare(self, request: gateway_pb2.GenerateRequest) -> Prepared:
        if request.model and request.model != self.model_name:
            raise UnknownModelError(
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

    # -- the one path of both front doors (gRPC Generate, OpenAI HTTP) -------------
    async def stream(
        self, request: gateway_pb2.GenerateRequest, principal: Principal = ANONYMOUS
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """Validate, charge the tenant's quota, take a stream slot, relay a RequestStream.

        `principal` (from `access.authenticate`) names the tenant: its prefix-cache salt
        and routing key. Raises before the first message: UnknownModelError,
        InvalidRequestError (naming the field), QuotaExceeded, StreamError
        RESOURCE_EXHAUSTED (stream cap) or NoWorkerError; after it, StreamError with the
        status. Closing the generator early cancels the request on both workers; the slot
        is always given back and the unused quota refunded.
        """
        try:
            prepared = replace(self.prepare(request), tenant=principal.tenant)
        except Exception as exc:
            self.telemetry.count_refusal(exc)
            raise
        if self.active >= self.config.max_streams:
            self.telemetry.count_error(grpc.StatusCode.RESOURCE_EXHAUSTED)
            raise StreamError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"max_streams: {self.config.max_streams} streams already running; retry later",
            )
        try:
            grant = await self.access.admit(
                principal, len(prepared.prompt), prepared.params.max_tokens
            )
        except QuotaExceeded:
            self.telemetry.count_error(grpc.StatusCode.RESOURCE_EXHAUSTED)
            raise
        self.active += 1
        relay = RequestStream(
            prepared,
            self.config,
            self.placement,
            self.stubs,
            IncrementalDetokenizer(self.tokenizer),
            self.telemetry,
        )
        try:
            # aclosing: an early close reaches RequestStream's cleanup now, not at GC.
            async with contextlib.aclosing(relay.run()) as messages:
                async for msg in messages:
                    yield msg
        finally:
            self.active -= 1
            await self.access.settle(grant, relay.completion_tokens)

    # -- RPCs --------------------------------------------------------------------
    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        try:
            principal = self.access.authenticate(context.invocation_metadata() or ())
            async with contextlib.aclosing(self.stream(request, principal)) as messages:
                async for msg in messages:
                    yield msg
        except AuthError as exc:
            await context.abort(auth_status(exc), str(exc))
        except QuotaExceeded as exc:
            retry_ms = str(round(exc.retry_after_s * 1000))
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), (("retry-after-ms", retry_ms),)
            )
        except UnknownModelError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except InvalidRequestError as exc:
            await context.abort(*status_for(exc))
        except (StreamError, NoWorkerError) as exc:
            await context.abort(exc.code, str(exc))

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
                whole.trace_id = msg.trace_id
                whole.phases.extend(msg.phases)
        return whole

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        await self._authorize(context)
        return gateway_pb2.ListModelsResponse(
            models=[gateway_pb2.ModelInfo(id=self.model_name, max_model_len=self.max_model_len)]
        )

    async def ClusterStatus(
        self, request: gateway_pb2.ClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ClusterStatusResponse:
        principal = await self._authorize(context)
        try:
            principal.require_admin("ClusterStatus")
        except AuthError as exc:
            await context.abort(auth_status(exc), str(exc))
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

    async def _authorize(self, context: grpc.aio.ServicerContext) -> Principal:
        try:
            return self.access.authenticate(context.invocation_metadata() or ())
        except AuthError as exc:
            await context.abort(auth_status(exc), str(exc))
            raise  # abort raises; this keeps the type checker honest


def auth_status(exc: AuthError) -> grpc.StatusCode:
    return grpc.StatusCode.PERMISSION_DENIED if exc.denied else grpc.StatusCode.UNAUTHENTICATED

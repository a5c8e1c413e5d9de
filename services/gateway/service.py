"""The Gateway gRPC service: validation, tokenization, admission, and streaming.

Lifecycle of a call: resolve the model the request names (`ModelCatalog`: the gateway's
primary model, or one of its extra models, each with its own tokenizer, limits, workers
and admission), check the input, tokenize with that model's tokenizer (chat template for
a message list), validate sampling against the context length and the operator's
`max_tokens_limit`, resolve the request's priority class against the caller's key (the
key's default, or what the request asks for up to the key's highest: PERMISSION_DENIED
above it), and start the clock on its total deadline (`request_deadline_s`); then open
the request's `RequestRecord`, charge the tenant's quota (or refuse at once:
RESOURCE_EXHAUSTED), pass admission control (`Admission`: admitted at once, or after a
wait in the waiting room, or refused: UNAVAILABLE), take a stream slot (or refuse:
RESOURCE_EXHAUSTED); every refusal carries a retry hint. Then relay a `RequestStream`
through the request's `StreamBuffer` (bounded: a client that stops
reading is disconnected). When the stream ends, however it ends (finished, failed, given
up on, or closed by a client that went away), the record's one cleanup gives back
everything it holds. Typed errors become gRPC statuses through the one table
(`services.common.status`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace

import grpc
import redis

from engine.errors import InvalidRequestError
from engine.request_check import RequestLimits, check_request
from engine.request_spec import RequestSpec
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2
from services.common.detokenizer import IncrementalDetokenizer
from services.common.status import (
    NoRolloutsError,
    NoWorkerError,
    Overloaded,
    Refusal,
    ServiceError,
    StatusError,
    abort_with,
    status_for,
)
from services.gateway.access.auth import ANONYMOUS, AuthError, Principal
from services.gateway.client_request import ClientRequest, InputKind, PromptInput, from_generate
from services.gateway.config import GatewayConfig
from services.gateway.flow.admission import Usage
from services.gateway.models.backend import Backend, SharedParts
from services.gateway.models.catalog import ModelCatalog
from services.gateway.models.rollout_admin import RolloutAdmin
from services.gateway.models.rollout_follower import OutcomeClock
from services.gateway.models.served_model import ServedModel, ServedModelSpec
from services.gateway.stream.buffer import Disconnect, StreamBuffer
from services.gateway.stream.errors import StreamError
from services.gateway.stream.prepared import Prepared, worker_request_id
from services.gateway.stream.record_book import Resource
from services.gateway.stream.request_record import RequestRecord
from services.gateway.stream.request_stream import RequestStream
from services.gateway.stream.telemetry import GatewayTelemetry

MAX_PROMPT_CHARS = 1_000_000
# Trailing metadata (gRPC) and header (HTTP, with x-pdserve-) naming a refusal's reason.
REFUSAL_REASON_KEY = "refusal-reason"


class GatewayService(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        config: GatewayConfig,
        models: ModelCatalog,
        parts: SharedParts,
        telemetry: GatewayTelemetry | None = None,
    ) -> None:
        """`models`: what the gateway serves (`build_catalog`, the primary first), each
        model served with `parts`, which every request shares too."""
        self.config = config
        self.models = models
        self.parts = parts
        self.access, self.stubs, self.book = parts.access, parts.stubs, parts.book
        self.telemetry = telemetry or GatewayTelemetry.disabled()
        self.rollouts: RolloutAdmin | None = None  # with Redis: `build_service` sets it

    def add_model(self, spec: ServedModelSpec) -> ServedModel:
        """Serve one more model (before the gateway starts serving): requests that name
        it use its tokenizer and limits, and go to its workers through its placement."""
        served = spec.serve(self.parts)
        self.models.add(served)
        return served

    @property
    def active(self) -> int:
        """Streams running: the stream slots live request records hold."""
        return self.book.count(Resource.STREAM_SLOT)

    def usage(self, backend: Backend) -> list[Usage]:
        """The KV blocks of the live requests placed through `backend`, for the
        fair-share ledger (each backend's admission charges its own requests to the one
        shared ledger)."""
        size = backend.admission.capacity.decode.block_size
        out = []
        for record in self.book.live():
            if record.keepers is not backend.keepers:
                continue
            blocks = record.kv_blocks(size)
            if blocks:
                out.append(Usage(record.req.priority, record.req.tenant, blocks))
        return out

    async def close(self) -> None:
        if self.rollouts is not None:
            await self.rollouts.close()
        for model in self.models:
            if model.follower is not None:
                await model.follower.close()
            for backend in model.backends():
                await backend.admission.close()
        await self.stubs.close()  # waits for the records' cleanups, which write usage
        if self.parts.ledger is not None:
            await asyncio.to_thread(self.parts.ledger.close)

    # -- validation --------------------------------------------------------------
    def prepare(self, client: ClientRequest, principal: Principal = ANONYMOUS) -> Prepared:
        """Tokenize `client`'s prompt with its model's tokenizer, check the request
        against the model and this gateway's limits (`engine.request_check`, the same
        check every engine runs), compile its grammar (a bad schema is a 400 before any
        worker is involved), resolve its class against the caller's key and start the
        clock on its total deadline."""
        served, adapter = client.model
        rid = client.request_id or uuid.uuid4().hex
        spec = RequestSpec(
            prompt_token_ids=self._tokens(client.prompt, served),
            sampling=client.sampling,
            request_id=worker_request_id(rid),
            cache_salt=principal.tenant,
            cache_weight=principal.weight,
            adapter=adapter,
        )
        limits = RequestLimits(
            served.max_model_len, served.vocab_size,
            max_tokens_limit=self.config.max_tokens_limit,
        )  # fmt: skip
        check_request(spec, limits)
        if spec.sampling.guided is not None:
            try:
                served.grammars().matcher(spec.sampling.guided)
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"sampling.{exc.field}", exc.limit) from exc
        spec = replace(spec, priority=principal.priority_for(client.priority))
        deadline = time.monotonic() + self.config.request_deadline_s
        return Prepared(spec, rid, deadline, principal.weight, served.name)

    @staticmethod
    def _tokens(prompt: PromptInput, served: ServedModel) -> list[int]:
        if prompt.kind is InputKind.TEXT:
            if len(prompt.text) > MAX_PROMPT_CHARS:
                raise InvalidRequestError("prompt", f"at most {MAX_PROMPT_CHARS} characters")
            return served.tokenizer.encode(prompt.text)
        if prompt.kind is InputKind.CHAT:
            if sum(len(m.content) for m in prompt.messages) > MAX_PROMPT_CHARS:
                raise InvalidRequestError(
                    "messages", f"at most {MAX_PROMPT_CHARS} characters in all"
                )
            return served.tokenizer.encode_chat(list(prompt.messages))
        return list(prompt.token_ids)

    # -- the one path of both front doors (gRPC Generate, OpenAI HTTP) -------------
    async def stream(
        self,
        client: ClientRequest,
        principal: Principal = ANONYMOUS,
        disconnect: Disconnect | None = None,
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """Validate, charge the quota, pass admission, take a stream slot, relay.

        `principal` (from `access.authenticate`) names the tenant (its prefix-cache salt
        and routing key) and the classes it may ask for. Raises before the first
        message: UnknownModelError, InvalidRequestError (naming the field),
        PermissionDeniedError (a class above the key's), a `Refusal` (QuotaExceeded,
        Overloaded, StreamCapReached: each with `retry_after_s`) or NoWorkerError;
        after it, StreamError with the status (DEADLINE_EXCEEDED past
        `request_deadline_s`). `disconnect` is how the front door ends its client's
        call when the client stops reading (see `StreamBuffer`). Closing the generator
        early cancels the request on both workers. However it ends, the record's cleanup
        gives everything back (admission pass, slot, load leases, prefill lease, unused
        quota) before this generator is done, unless its task is cancelled again
        meanwhile: then the cleanup finishes on its own.
        """
        try:
            prepared = self.prepare(client, principal)
        except Exception as exc:
            self.telemetry.count_refusal(exc)
            raise
        served = client.model.served
        backend = served.pick(prepared.tenant)
        record = RequestRecord(prepared, backend.keepers)
        buffer = StreamBuffer(record, self.config, prepared.deadline, disconnect)
        timing = OutcomeClock()
        try:
            await self._admit(record, principal, backend)
            skip = prepared.params.skip_special_tokens
            detok = IncrementalDetokenizer(served.tokenizer, skip_special_tokens=skip)
            relay = RequestStream(record, self.config, detok, self.telemetry, backend.sites)
            timing.admitted()
            buffer.start(relay.run(), timing.message)
            while (msg := await buffer.next()) is not None:
                yield msg
            timing.ended(ok=True)
        except (StreamError, NoWorkerError):
            if not buffer.gave_up_on_client:  # a slow client is no fault of the version's
                timing.ended(ok=False)  # the version's failure: it counts against a canary
            raise
        finally:
            buffer.stop()
            await record.close()
            if served.follower is not None and timing.outcome is not None:
                served.follower.observe(backend.version, timing.outcome)
                self.telemetry.count_version(served.name, backend.version, timing.outcome.ok)

    async def _admit(self, record: RequestRecord, principal: Principal, backend: Backend) -> None:
        """Quota first (a tenant over it is told at once), then the admission control of
        the model version's pools (which may wait), then a stream slot."""
        admission = backend.admission
        admission.start(lambda: self.usage(backend))
        try:
            await record.charge(principal)
            await record.admit(admission)
            record.take_slot(self.config.max_streams)
        except Refusal as exc:
            self.telemetry.count_refusal(exc, record.req.model)
            self.telemetry.count_tenant_refusal(record.req.tenant, record.req.priority)
            if not isinstance(exc, Overloaded):  # admission counts its own
                admission.metrics.refused(record.req.priority, exc.reason)
            raise

    # -- RPCs --------------------------------------------------------------------
    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        disconnect = GrpcDisconnect(context)
        try:
            principal = self.access.authenticate(context.invocation_metadata() or ())
            stream = self.stream(self.decode(request), principal, disconnect)
            async with contextlib.aclosing(stream) as messages:
                async for msg in messages:
                    yield msg
        except Refusal as exc:
            retry_ms = str(round(exc.retry_after_s * 1000))
            trailing = (("retry-after-ms", retry_ms), (REFUSAL_REASON_KEY, exc.reason.value))
            await context.abort(*status_for(exc), trailing)
        except (ServiceError, InvalidRequestError, StatusError) as exc:
            if not disconnect.done:  # the call has its status already
                await abort_with(context, exc)

    def decode(self, request: gateway_pb2.GenerateRequest) -> ClientRequest:
        """The gRPC front door's request, decoded once; a refusal is counted."""
        try:
            return from_generate(request, self.models)
        except Exception as exc:
            self.telemetry.count_refusal(exc)
            raise

    async def Complete(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GenerateResponse:
        if request.sampling.n > 1:
            message = "sampling.n: Complete returns one answer; use Generate for n > 1"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
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
        cards = self.models.cards()
        return gateway_pb2.ListModelsResponse(
            models=[
                gateway_pb2.ModelInfo(id=c.id, max_model_len=c.max_model_len, parent=c.parent)
                for c in cards
            ]
        )

    async def ClusterStatus(
        self, request: gateway_pb2.ClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ClusterStatusResponse:
        principal = await self._authorize(context)
        try:
            principal.require_admin("ClusterStatus")
        except AuthError as exc:
            await abort_with(context, exc)
        reply = gateway_pb2.ClusterStatusResponse(
            active_streams=self.active, max_streams=self.config.max_streams
        )
        if self.rollouts is not None:
            reply.rollouts.extend(await self.rollouts.statuses())
        for ref in [w for p in self.models.placements() for w in p.workers()]:
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

    async def Rollout(
        self, request: gateway_pb2.RolloutRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RolloutStatus:
        principal = await self._authorize(context)
        try:
            principal.require_admin("Rollout")
            if self.rollouts is None:
                raise NoRolloutsError("rollouts need Redis: start the gateway with placement redis")
            return await self.rollouts.act(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except redis.RedisError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"rollout state unreachable: {exc}")
        except (ServiceError, StatusError) as exc:
            await abort_with(context, exc)
        raise AssertionError("abort raises")  # keeps the type checker honest

    async def _authorize(self, context: grpc.aio.ServicerContext) -> Principal:
        try:
            return self.access.authenticate(context.invocation_metadata() or ())
        except AuthError as exc:
            await abort_with(context, exc)
            raise  # abort raises; this keeps the type checker honest


class GrpcDisconnect:
    """Ends a Generate call whose client stopped reading (`StreamBuffer`'s `disconnect`).

    It runs in the request's pump task: the call's own task is stuck handing gRPC a
    message the client does not read. `abort` from here sends the status at once (the
    client gets it after the messages it has yet to read), and gRPC then closes the
    call's generator, which ends the request as a client that went away would.
    """

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context
        self.done = False

    async def __call__(self, error: StatusError) -> None:
        self.done = True
        with contextlib.suppress(Exception):  # abort raises by design
            await self.context.abort(error.code, str(error))

"""The Gateway gRPC service: validation, tokenization, admission, and streaming.

Lifecycle of a call: check the model name and the input, tokenize (chat template for a
message list), validate sampling against the context length and the operator's
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

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace

import grpc

from engine.errors import InvalidRequestError
from engine.grammar import GrammarCompiler
from engine.tokenizer import ChatMessage, Tokenizer
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2
from services.common import priority_proto, sampling
from services.common.detokenizer import IncrementalDetokenizer
from services.common.status import (
    Overloaded,
    Refusal,
    ServiceError,
    StatusError,
    UnknownModelError,
    abort_with,
    status_for,
)
from services.gateway.access import Access
from services.gateway.admission import Admission, Usage
from services.gateway.auth import ANONYMOUS, AuthError, Principal
from services.gateway.config import GatewayConfig
from services.gateway.prefill_site import SitePolicy
from services.gateway.record_book import RecordBook, Resource
from services.gateway.request_record import Keepers, Prepared, RequestRecord
from services.gateway.request_stream import RequestStream
from services.gateway.stream_buffer import Disconnect, StreamBuffer
from services.gateway.stream_telemetry import GatewayTelemetry
from services.gateway.worker_stubs import WorkerStubs
from services.router.placement import Placement

MAX_PROMPT_CHARS = 1_000_000
# Trailing metadata (gRPC) and header (HTTP, with x-pdserve-) naming a refusal's reason.
REFUSAL_REASON_KEY = "refusal-reason"


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
        admission: Admission | None = None,
    ) -> None:
        self.config = config
        self.access = access or Access.open()
        self.telemetry = telemetry or GatewayTelemetry.disabled()
        self.placement = placement
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.stubs = stubs or WorkerStubs()
        self.book: RecordBook[RequestRecord] = RecordBook()
        self.keepers = Keepers(placement, self.access, self.stubs, self.book)
        self.admission = admission or Admission(config)
        capacity = self.admission.capacity
        self.sites = SitePolicy(
            config.local_prefill_max_tokens, config.local_prefill_busy_s, capacity.queue_s
        )
        self._grammar_compiler: GrammarCompiler | None = None

    @property
    def active(self) -> int:
        """Streams running: the stream slots live request records hold."""
        return self.book.count(Resource.STREAM_SLOT)

    def usage(self) -> list[Usage]:
        """The live requests' KV blocks on the workers, for the fair-share ledger."""
        size = self.admission.capacity.decode.block_size
        out = []
        for record in self.book.live():
            blocks = record.kv_blocks(size)
            if blocks:
                out.append(Usage(record.req.priority, record.req.tenant, blocks))
        return out

    async def close(self) -> None:
        await self.admission.close()
        await self.stubs.close()

    # -- validation --------------------------------------------------------------
    def prepare(self, request: gateway_pb2.GenerateRequest) -> Prepared:
        if request.model and request.model != self.model_name:
            raise UnknownModelError(
                f"model: {request.model!r} is not served here (serving {self.model_name!r})"
            )
        params = sampling.from_proto(request.sampling)
        if params.max_tokens > self.config.max_tokens_limit:
            raise InvalidRequestError(
                "sampling.max_tokens",
                f"must be <= {self.config.max_tokens_limit} (this gateway's max_tokens_limit)",
                params.max_tokens,
            )
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
        if any(t >= self.vocab_size for t, _ in params.logit_bias):
            raise InvalidRequestError(
                "sampling.logit_bias", f"each token id must be < {self.vocab_size}"
            )
        if params.guided is not None:
            # Compile here too: a bad schema is a 400 before any worker is involved.
            try:
                self._grammars().matcher(params.guided)
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"sampling.{exc.field}", exc.limit) from exc
        deadline = time.monotonic() + self.config.request_deadline_s
        return Prepared(request.request_id or uuid.uuid4().hex, prompt, params, "", deadline)

    def _grammars(self) -> GrammarCompiler:
        if self._grammar_compiler is None:  # built on first use: it indexes the vocabulary
            self._grammar_compiler = GrammarCompiler.of(self.tokenizer, self.vocab_size)
        return self._grammar_compiler

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
        if which == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
            if any(t >= self.vocab_size for t in ids):
                raise InvalidRequestError(
                    "prompt_token_ids", f"each id must be < the vocabulary size {self.vocab_size}"
                )
            return ids
        raise InvalidRequestError("input", "set prompt, messages or prompt_token_ids")

    # -- the one path of both front doors (gRPC Generate, OpenAI HTTP) -------------
    async def stream(
        self,
        request: gateway_pb2.GenerateRequest,
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
            prepared = self.prepare(request)
            asked = priority_proto.from_proto(request.priority)
            prepared = replace(
                prepared, tenant=principal.tenant, priority=principal.priority_for(asked),
                weight=principal.weight,
            )  # fmt: skip
        except Exception as exc:
            self.telemetry.count_refusal(exc)
            raise
        record = RequestRecord(prepared, self.keepers)
        buffer = StreamBuffer(record, self.config, prepared.deadline, disconnect)
        try:
            await self._admit(record, principal)
            skip = prepared.params.skip_special_tokens
            detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=skip)
            relay = RequestStream(
                record, self.config, self.stubs, detok, self.telemetry, self.sites
            )
            buffer.start(relay.run())
            while (msg := await buffer.next()) is not None:
                yield msg
        finally:
            buffer.stop()
            await record.close()

    async def _admit(self, record: RequestRecord, principal: Principal) -> None:
        """Quota first (a tenant over it is told at once), then admission control (which
        may wait), then a stream slot."""
        self.admission.start(self.usage)
        try:
            await record.charge(principal)
            await record.admit(self.admission)
            record.take_slot(self.config.max_streams)
        except Refusal as exc:
            self.telemetry.count_refusal(exc)
            if not isinstance(exc, Overloaded):  # admission counts its own
                self.admission.metrics.refused(record.req.priority, exc.reason)
            raise

    # -- RPCs --------------------------------------------------------------------
    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        disconnect = GrpcDisconnect(context)
        try:
            principal = self.access.authenticate(context.invocation_metadata() or ())
            stream = self.stream(request, principal, disconnect)
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
            await abort_with(context, exc)
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

"""One client request through the cluster: prefill, then decode, streamed as text.

Lifecycle: `RequestStream(...).run()` is an async generator of GenerateResponse.
1. route: placement picks a prefill and a decode worker (or one mixed worker);
2. prefill: the prefill worker returns token 1 and a KvHandle, under its own deadline;
   if the worker is unreachable or misses the deadline, the request is routed again
   excluding it and retried once; token 1 is streamed (TTFT ends here);
3. decode: the decode worker imports the KV and streams the rest; the first decode
   token has its own deadline (it includes the transfer), later tokens an idle deadline;
4. the last message carries usage and the finish reason (and the trace id and phase
   timeline: `StreamTelemetry` traces and measures every step above).
After token 1 a failure ends the stream with a typed status (never a hang). If the
client goes away, the generator is closed: the decode stream is cancelled (the decode
worker aborts the request) and an un-pulled prefill lease is dropped with Abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, gateway_pb2, worker_pb2
from services.common import sampling
from services.common.detokenizer import IncrementalDetokenizer
from services.common.log_format import log_context
from services.gateway.config import GatewayConfig
from services.gateway.stop_text import StopTrimmer
from services.gateway.stream_telemetry import GatewayTelemetry
from services.router.placement import NoWorkerError, Placement, RouteDecision

if TYPE_CHECKING:
    from services.gateway.service import WorkerStubs

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class StreamError(Exception):
    """Ends the client's stream with this gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Prepared:
    request_id: str  # the client's (or a generated one): in responses, logs and spans
    prompt: list[int]
    params: SamplingParams
    tenant: str
    # The id the workers see. A client-chosen id need not be unique (two clients, or one
    # retrying, may send the same), and a worker holding a live request under that id
    # refuses the second one and lets the first one stall; so each request gets its own.
    worker_request_id: str = ""

    def __post_init__(self) -> None:
        if not self.worker_request_id:
            self.worker_request_id = f"{self.request_id}.{uuid.uuid4().hex[:8]}"


class RequestStream:
    def __init__(
        self,
        req: Prepared,
        config: GatewayConfig,
        placement: Placement,
        stubs: WorkerStubs,
        detok: IncrementalDetokenizer,
        telemetry: GatewayTelemetry | None = None,
    ) -> None:
        self.req = req
        self.config = config
        self.placement = placement
        self.stubs = stubs
        self.detok = detok
        self.trim = StopTrimmer(req.params.stop)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self._decisions: list[RouteDecision] = []
        self._unpulled: tuple[str, str] | None = None  # (prefill address, request id)
        self.tel = (telemetry or GatewayTelemetry.disabled()).stream(
            req.request_id, req.tenant, len(req.prompt)
        )

    async def run(self) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        self.tel.begin()
        try:
            with log_context(self.req.request_id, self.tel.trace_id):
                decision, first = await self._prefill_with_retry()
            if first is None:
                async for msg in self._decode(decision, None):
                    yield msg
                return
            yield self._delta([first.first_token_id], prefill=decision)
            if first.finished:
                yield self._final(first.finish_reason)
                return
            async for msg in self._decode(decision, first.kv_handle):
                yield msg
        except (StreamError, NoWorkerError) as exc:
            self.tel.failed(exc.code, str(exc))
            raise
        except (asyncio.CancelledError, GeneratorExit):
            self.tel.cancelled()
            raise
        except Exception as exc:
            self.tel.failed(grpc.StatusCode.INTERNAL, str(exc))
            raise
        finally:
            # Its own task: this one can be cancelled again while it cleans up.
            await self.stubs.finish(self._cleanup())

    # -- prefill -----------------------------------------------------------------
    async def _prefill_with_retry(self) -> tuple[RouteDecision, worker_pb2.PrefillResponse | None]:
        failed: list[str] = []
        for attempt in range(self.config.prefill_retries + 1):
            decision = await self.tel.route(
                self.placement.route(self.req.request_id, self.req.prompt, self.req.tenant, failed),
                attempt,
            )
            self._decisions.append(decision)
            if decision.prefill is None:
                return decision, None
            try:
                return decision, await self._prefill(decision)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE or attempt == self.config.prefill_retries:
                    raise StreamError(
                        exc.code(), f"prefill worker {decision.prefill.worker_id}: {exc.details()}"
                    ) from exc
                failed.append(decision.prefill.worker_id)
        raise AssertionError("unreachable")

    async def _prefill(self, decision: RouteDecision) -> worker_pb2.PrefillResponse:
        assert decision.prefill is not None
        request = worker_pb2.PrefillRequest(
            request_id=self.req.worker_request_id, prompt_token_ids=self.req.prompt,
            sampling=sampling.to_proto(self.req.params), cache_salt=self.req.tenant,
        )  # fmt: skip
        stub = self.stubs[decision.prefill.address]
        self._unpulled = (decision.prefill.address, self.req.worker_request_id)
        response: worker_pb2.PrefillResponse = await stub.Prefill(
            request, timeout=self.config.prefill_timeout_s, metadata=self.tel.metadata()
        )
        if response.finished:
            self._unpulled = None
        self.cached_tokens = response.cached_tokens
        self.tel.add_phases(response.phases)
        return response

    # -- decode ------------------------------------------------------------------
    async def _decode(
        self, decision: RouteDecision, handle: common_pb2.KvHandle | None
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        request = worker_pb2.DecodeRequest(
            request_id=self.req.worker_request_id, prompt_token_ids=self.req.prompt,
            sampling=sampling.to_proto(self.req.params), cache_salt=self.req.tenant,
        )  # fmt: skip
        if handle is not None:
            request.kv_handle.CopyFrom(handle)
        call = self.stubs[decision.decode.address].Decode(request, metadata=self.tel.metadata())
        self._unpulled = None  # the decode worker owns the lease from here
        timeout = self.config.first_token_timeout_s
        first = handle is None
        first_read: asyncio.Future[worker_pb2.DecodeChunk | None] | None = None
        try:
            while True:
                if handle is not None and first_read is None:
                    # Shielded: see the `finally` below.
                    first_read = asyncio.ensure_future(self._read(call, timeout, decision))
                    chunk = await asyncio.shield(first_read)
                else:
                    chunk = await self._read(call, timeout, decision)
                timeout = self.config.token_timeout_s
                if chunk is None:
                    raise StreamError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"decode worker {decision.decode.worker_id} ended the stream early",
                    )
                if handle is None and chunk.cached_tokens:
                    self.cached_tokens = chunk.cached_tokens
                if chunk.phases:
                    self.tel.add_phases(chunk.phases)
                if chunk.token_ids:
                    yield self._delta(
                        list(chunk.token_ids), prefill=decision if first else None, decode=decision
                    )
                    first = False
                if chunk.finished:
                    yield self._final(chunk.finish_reason)
                    return
        finally:
            if first_read is not None and not first_read.done():
                # The client left before the first chunk. A decode call cancelled before
                # the worker's handler runs never starts the KV import, so nobody would
                # release the prefill worker's lease (its blocks would stay pinned for
                # kv_lease_ttl_s). Let the read finish in the background instead (a
                # chunk means the import is over) and cancel the call then.
                self.stubs.linger(first_read, call)
            else:
                call.cancel()

    async def _read(
        self, call: grpc.aio.UnaryStreamCall, timeout: float, decision: RouteDecision
    ) -> worker_pb2.DecodeChunk | None:
        try:
            chunk = await asyncio.wait_for(call.read(), timeout)
        except TimeoutError as exc:
            raise StreamError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"decode worker {decision.decode.worker_id} sent no token for {timeout:.1f}s",
            ) from exc
        except grpc.aio.AioRpcError as exc:
            raise StreamError(
                exc.code(), f"decode worker {decision.decode.worker_id}: {exc.details()}"
            ) from exc
        if chunk is grpc.aio.EOF:
            return None
        assert isinstance(chunk, worker_pb2.DecodeChunk)
        return chunk

    # -- messages ----------------------------------------------------------------
    def _delta(
        self,
        tokens: list[int],
        *,
        prefill: RouteDecision | None = None,
        decode: RouteDecision | None = None,
    ) -> gateway_pb2.GenerateResponse:
        self.completion_tokens += len(tokens)
        self.tel.on_tokens(len(tokens))
        text = self.trim.push(self.detok.push(tokens))
        msg = gateway_pb2.GenerateResponse(
            request_id=self.req.request_id, text=text, token_ids=tokens
        )
        if prefill is not None:
            msg.prefill_worker = (
                prefill.prefill.worker_id if prefill.prefill else prefill.decode.worker_id
            )
        if decode is not None:
            msg.decode_worker = decode.decode.worker_id
        return msg

    def _final(self, reason: int) -> gateway_pb2.GenerateResponse:
        text = self.trim.push(self.detok.flush()) + self.trim.flush()
        msg = gateway_pb2.GenerateResponse(
            request_id=self.req.request_id, text=text, finished=True, finish_reason=reason,
            usage=common_pb2.Usage(
                prompt_tokens=len(self.req.prompt), cached_tokens=self.cached_tokens,
                completion_tokens=self.completion_tokens,
            ),
        )  # fmt: skip
        self.tel.finish(msg)  # trace id and phase timeline; latency and goodput metrics
        return msg

    async def _cleanup(self) -> None:
        """Give back what the request holds: load leases, an un-pulled prefill lease.

        Runs as its own task (`WorkerStubs.finish`), so a second cancel of the request's
        task cannot cut it short. Releases start when called (`Placement.release`), all
        before the Abort's round trip.
        """
        try:
            decisions, self._decisions = self._decisions, []
            releases = asyncio.gather(*(self.placement.release(d) for d in decisions))
            if self._unpulled is not None:
                address, rid = self._unpulled
                self._unpulled = None
                # If the worker is gone, its lease expires on its own.
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self.stubs[address].Abort(
                        worker_pb2.AbortRequest(request_id=rid), timeout=2.0
                    )
            await releases
        finally:
            self.tel.end()

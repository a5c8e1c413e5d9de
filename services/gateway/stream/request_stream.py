"""One client request through the cluster: prefill, then decode, streamed as text.

Lifecycle: `RequestStream(record, ...).run()` is an async generator of GenerateResponse
for a request already admitted (its `RequestRecord` holds a stream slot and its quota
charge). It moves the record through its states:
1. route: placement picks a prefill and a decode worker (or one mixed worker); with
   both, conditional disaggregation (`prefill_site`) may drop the prefill side, and the
   decode worker then prefills the prompt itself (as a mixed worker does, no handle),
   or, with elastic roles, drop the decode side: the prefill worker runs it whole;
2. prefill: the prefill worker returns token 1 and a KvHandle, under its own deadline;
   if the worker is unreachable or misses the deadline, the request is routed again
   excluding it and retried once; token 1 is streamed (TTFT ends here);
3. decode: the decode worker imports the KV and streams the rest; the first decode
   token has its own deadline (it includes the transfer), later tokens an idle deadline.
   Each Decode call is a `DecodeAttempt` of the stream's `StreamRecovery`
   (`stream.recovery`), which names the next one when a call fails: another decode
   worker when one refused the request before its first chunk (decode reroute), the
   same one computing the prompt when its import found the KV gone (re-prefill), or,
   after tokens went out, another one resuming after them when the worker died or
   stalled (migration); else the stream ends with the failed call's status;
4. the last message carries usage and the finish reason (and the trace id and phase
   timeline: `StreamTelemetry` traces and measures every step above).
Both worker calls carry the request's class, and no wait outlasts the request's total
deadline (`Prepared.deadline`): each hop's timeout is cut to the time left, which the
workers also get as their gRPC deadline (their engine's `deadline`), and a hop that
misses it ends the stream with DEADLINE_EXCEEDED naming `request_deadline_s`, never a
retry. Otherwise, after token 1 only a worker's death or a deadline ends the stream with
an error (a typed status, never a hang). Nothing here gives anything back: whoever made
the record closes it when this generator ends, however it ends (the decode stream
cancelled, an un-pulled prefill lease aborted, load leases released, quota refunded:
`RequestRecord.close`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from engine.request_spec import RequestSpec
from pdserve.v1 import common_pb2, gateway_pb2, worker_pb2
from services.common import request_codec
from services.common.detokenizer import IncrementalDetokenizer
from services.common.log_format import log_context
from services.common.status import NoWorkerError
from services.gateway.config import GatewayConfig
from services.gateway.flow.prefill_site import PrefillSite, SiteChoice, SitePolicy
from services.gateway.stream.decode_retry import REFUSALS
from services.gateway.stream.errors import (
    Deadline,
    DecodeRefused,
    KvLost,
    StreamError,
    WorkerLost,
)
from services.gateway.stream.metrics import NO_MODEL
from services.gateway.stream.recovery import DecodeAttempt, StreamRecovery
from services.gateway.stream.request_record import RequestRecord
from services.gateway.stream.stop_text import StopTrimmer
from services.gateway.stream.telemetry import GatewayTelemetry, StreamLabels
from services.router.placement import RouteDecision

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
#: A prefill worker may also be out of something another has: a free LoRA adapter slot
#: (AdaptersBusyError) when the request's adapter is loaded nowhere with room.
PREFILL_RETRYABLE = (*RETRYABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
#: A decode worker's import failed this way before its first chunk: the KV is gone
#: (lease ended, exporter unreachable) or corrupt (checksums failed twice), not the worker.
KV_LOST = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS)


@dataclass(frozen=True)
class Workers:
    """The workers a message names (empty: none): the prefill worker on a request's first
    message (a mixed or locally prefilled request's decode worker), the decode worker on
    each of its decode messages."""

    prefill: str = ""
    decode: str = ""


def prefilled_by(decision: RouteDecision) -> str:
    return decision.prefill.worker_id if decision.prefill else decision.decode.worker_id


class RequestStream:
    def __init__(
        self,
        record: RequestRecord,
        config: GatewayConfig,
        detok: IncrementalDetokenizer,
        telemetry: GatewayTelemetry | None = None,
        sites: SitePolicy | None = None,
    ) -> None:
        self.record = record
        self.sites = sites or SitePolicy(0, 0.0)
        self.req = record.req
        self.config = config
        self.stubs = record.keepers.stubs  # the gateway's, as the record's cleanup uses
        # Each fork (n > 1) has its own text: detokenizer and stop trimmer, by index.
        self.texts: dict[int, tuple[IncrementalDetokenizer, StopTrimmer]] = {}
        self.detok = detok
        self.open_forks = self.req.params.n  # the stream ends when each fork has
        self.prompt_sent = False  # prompt_logprobs go on the first message only
        labels = StreamLabels(
            self.req.request_id, self.req.tenant, len(self.req.prompt), self.req.priority,
            self.req.model or NO_MODEL,
        )  # fmt: skip
        self.tel = (telemetry or GatewayTelemetry.disabled()).stream(labels)
        self.deadline = Deadline(self.req.deadline, config.request_deadline_s)
        self.recovery = StreamRecovery(record, config, self.tel, self.sites, self._prefill_call)

    async def run(self) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        self.tel.begin()
        try:
            with log_context(self.req.request_id, self.tel.trace_id):
                decision, first = await self._prefill_with_retry()
            if first is None:
                async for msg in self._decode_with_retry(decision, None):
                    yield msg
                return
            lps = list(first.first_logprobs)
            yield self._delta(
                [first.first_token_id], workers=Workers(prefill=prefilled_by(decision)),
                logprobs=lps[:1], prompt_logprobs=first.prompt_logprobs,
            )  # fmt: skip
            for index, token in enumerate(first.fork_token_ids, start=1):
                yield self._delta([token], index=index, logprobs=lps[index : index + 1])
            if first.finished:
                yield self._final(first.finish_reason)
                return
            async for msg in self._decode_with_retry(decision, first.kv_handle):
                yield msg
        except (StreamError, NoWorkerError) as exc:
            self.record.failed()
            self.tel.failed(exc.code, str(exc))
            raise
        except (asyncio.CancelledError, GeneratorExit):
            self.tel.cancelled()
            raise
        except Exception as exc:
            self.record.failed()
            self.tel.failed(grpc.StatusCode.INTERNAL, str(exc))
            raise
        finally:
            self.tel.end()

    # -- prefill -----------------------------------------------------------------
    async def _prefill_with_retry(self) -> tuple[RouteDecision, worker_pb2.PrefillResponse | None]:
        failed: list[str] = []
        for attempt in range(self.config.prefill_retries + 1):
            decision = await self.tel.route(self.record.route(failed), attempt)
            if decision.prefill is None:
                return decision, None
            choice = self._prefill_site(decision)
            if choice.site is PrefillSite.LOCAL:
                return self.record.skip_prefill(decision), None
            if choice.site is PrefillSite.PREFILL_WORKER:
                return self.record.serve_on_prefill(decision), None
            try:
                return decision, await self._prefill(decision)
            except grpc.aio.AioRpcError as exc:
                self.sites.withdraw(choice)  # placed again below, or the stream ends
                if self.deadline.passed():  # no time left to retry in
                    raise self.deadline.error() from exc
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self.record.report_down(decision.prefill.worker_id)
                if exc.code() not in PREFILL_RETRYABLE or attempt == self.config.prefill_retries:
                    raise StreamError(
                        exc.code(), f"prefill worker {decision.prefill.worker_id}: {exc.details()}"
                    ) from exc
                failed.append(decision.prefill.worker_id)
            except BaseException:  # cancelled or out of time: the stream ends here
                self.sites.withdraw(choice)
                raise
        raise AssertionError("unreachable")

    def _prefill_site(self, decision: RouteDecision) -> SiteChoice:
        """Conditional disaggregation and elastic roles (`prefill_site`): whether the
        prompt takes the hop, is prefilled by the decode worker, or the prefill worker
        runs the request whole; the choice is traced and counted."""
        assert decision.prefill is not None
        choice = self.sites.choose(
            len(self.req.prompt), decision.decode_cached_tokens,
            decision.prefill.worker_id, decision.decode.worker_id,
        )  # fmt: skip
        self.tel.disaggregation(choice)
        return choice

    async def _prefill(self, decision: RouteDecision) -> worker_pb2.PrefillResponse:
        response = await self._prefill_call(decision, self.req.spec)
        self.record.cached_tokens = response.cached_tokens
        self.tel.add_phases(response.phases)
        return response

    async def _prefill_call(
        self, decision: RouteDecision, spec: RequestSpec
    ) -> worker_pb2.PrefillResponse:
        """One Prefill call for `spec` to `decision`'s prefill worker; the record knows
        that worker may hold the request's KV under a lease from now on."""
        assert decision.prefill is not None
        request = request_codec.prefill_request(spec)
        address = decision.prefill.address
        timeout = min(self.config.prefill_timeout_s, self.deadline.left())
        self.record.prefill_sent(address)
        response: worker_pb2.PrefillResponse = await self.stubs[address].Prefill(
            request, timeout=timeout, metadata=self.tel.metadata()
        )
        self.record.prefill_done(address, finished=response.finished)
        return response

    # -- decode ------------------------------------------------------------------
    async def _decode_with_retry(
        self, decision: RouteDecision, handle: common_pb2.KvHandle | None
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Decode on `decision`'s decode worker; when a call fails, the stream's recovery
        policy names the next attempt, or raises the status that ends the stream."""
        attempt = self.recovery.first(decision, handle)
        while True:
            try:
                async for msg in self._decode(attempt):
                    yield msg
                return
            except DecodeRefused as refused:
                attempt = await self.recovery.after_refusal(attempt, refused)
            except (WorkerLost, KvLost) as lost:
                attempt = await self.recovery.after_loss(attempt, lost)

    async def _decode(self, attempt: DecodeAttempt) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """One Decode call; DecodeRefused when it fails before its first chunk with a
        status another attempt may cure, KvLost when its import finds the KV gone,
        WorkerLost when the worker dies or stalls. Its first chunk is due by the
        attempt's first-token deadline; the attempt's `resume`: the tokens a migrated
        stream already sent (the prompt's log-probabilities went out with them)."""
        decision, handle, resume = attempt.decision, attempt.handle, attempt.resume
        first_by = attempt.retry.first_token_deadline
        spec = self.req.later_spec(resume) if resume else self.req.spec
        request = request_codec.decode_request(spec, handle)
        call = self.stubs[decision.decode.address].Decode(
            request, timeout=self.deadline.left(), metadata=self.tel.metadata()
        )
        self.record.decode_opened(call, local=handle is None)
        pulled_from = decision.prefill.address if decision.prefill and handle else None
        chunk = await self._first_chunk(call, first_by, decision, imported=handle is not None)
        # Any chunk comes after the import: the decode worker has the KV now.
        self.record.decode_started(pulled_from)
        first = handle is None and not resume  # a mixed request's prefill is here
        while True:
            if first and chunk.cached_tokens:
                self.record.cached_tokens = chunk.cached_tokens
            if chunk.phases:
                self.tel.add_phases(chunk.phases)
            if chunk.token_ids:
                prefill = prefilled_by(decision) if first else ""
                yield self._delta(
                    list(chunk.token_ids), workers=Workers(prefill, decision.decode.worker_id),
                    logprobs=chunk.logprobs, prompt_logprobs=chunk.prompt_logprobs,
                    index=chunk.index,
                )  # fmt: skip
                first = False
            if chunk.finished:
                if self.open_forks == 1:
                    self.record.decode_ended()
                yield self._final(chunk.finish_reason, chunk.index)
                if self.open_forks == 0:
                    return
            chunk = await self._read(call, self.config.token_timeout_s, decision)

    async def _first_chunk(
        self,
        call: grpc.aio.UnaryStreamCall,
        first_by: float,
        decision: RouteDecision,
        *,
        imported: bool,
    ) -> worker_pb2.DecodeChunk:
        """The call's first chunk (after the KV import, when `imported`), due by
        `first_by`."""
        limit = f"first_token_timeout_s ({self.config.first_token_timeout_s:g}s)"
        try:
            return await self._read(call, first_by - time.monotonic(), decision, limit)
        except StreamError as exc:
            if imported and exc.code in KV_LOST:
                raise KvLost(exc.code, str(exc)) from exc
            refusal = REFUSALS.get(exc.code)
            if refusal is None:
                raise
            raise DecodeRefused(exc.code, str(exc), refusal) from exc

    async def _read(
        self,
        call: grpc.aio.UnaryStreamCall,
        timeout: float,
        decision: RouteDecision,
        limit: str = "",
    ) -> worker_pb2.DecodeChunk:
        """The next chunk within `timeout` (`limit` names it in the error); StreamError on
        a missed deadline, a failed or ended stream."""
        worker = decision.decode.worker_id
        wait = max(0.0, min(timeout, self.deadline.left()))
        try:
            chunk = await asyncio.wait_for(call.read(), wait)
        except TimeoutError as exc:
            if self.deadline.passed():
                raise self.deadline.error() from exc
            raise WorkerLost(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"decode worker {worker} sent no token "
                + (f"within {limit}" if limit else f"for {timeout:.1f}s"),
            ) from exc
        except grpc.aio.AioRpcError as exc:
            self.record.decode_ended()
            if self.deadline.passed():  # the call's own deadline: the request's
                raise self.deadline.error() from exc
            error = WorkerLost if exc.code() == grpc.StatusCode.UNAVAILABLE else StreamError
            raise error(exc.code(), f"decode worker {worker}: {exc.details()}") from exc
        if chunk is grpc.aio.EOF:
            self.record.decode_ended()
            raise WorkerLost(
                grpc.StatusCode.UNAVAILABLE, f"decode worker {worker} ended the stream early"
            )
        assert isinstance(chunk, worker_pb2.DecodeChunk)
        return chunk

    # -- messages ----------------------------------------------------------------
    def _delta(
        self,
        tokens: list[int],
        *,
        workers: Workers = Workers(),
        logprobs: Sequence[common_pb2.TokenLogprobs] = (),
        prompt_logprobs: Sequence[common_pb2.TokenLogprobs] = (),
        index: int = 0,
    ) -> gateway_pb2.GenerateResponse:
        self.record.generated(len(tokens))
        self.tel.on_tokens(len(tokens))
        if index == 0:
            self.recovery.sent(tokens)
        detok, trim = self._text(index)
        text = trim.push(detok.push(tokens))
        msg = gateway_pb2.GenerateResponse(
            request_id=self.req.request_id, text=text, token_ids=tokens, logprobs=logprobs,
            index=index,
        )  # fmt: skip
        if self.req.params.prompt_logprobs is not None and not self.prompt_sent:
            self.prompt_sent = True
            msg.prompt_logprobs.extend(prompt_logprobs)
            msg.prompt_token_ids.extend(self.req.prompt)
        if workers.prefill:
            msg.prefill_worker = workers.prefill
        if workers.decode:
            msg.decode_worker = workers.decode
        return msg

    def _text(self, index: int) -> tuple[IncrementalDetokenizer, StopTrimmer]:
        if index not in self.texts:
            params = self.req.params
            detok = self.detok if not self.texts else self.detok.fresh()
            trim = StopTrimmer(params.stop, include_stop=params.include_stop_str_in_output)
            self.texts[index] = (detok, trim)
        return self.texts[index]

    def _final(self, reason: int, index: int = 0) -> gateway_pb2.GenerateResponse:
        """A fork's last message; `reason` is the worker's FinishReason, passed on as it
        is (max_tokens: LENGTH on every path). The last fork's carries the usage."""
        detok, trim = self._text(index)
        text = trim.push(detok.flush()) + trim.flush()
        msg = gateway_pb2.GenerateResponse(
            request_id=self.req.request_id, text=text, finished=True, finish_reason=reason,
            index=index,
        )  # fmt: skip
        self.open_forks -= 1
        if self.open_forks > 0:
            return msg
        self.record.finished()
        msg.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=len(self.req.prompt), cached_tokens=self.record.cached_tokens,
                completion_tokens=self.record.completion_tokens,
            )
        )  # fmt: skip
        self.tel.finish(msg)  # trace id and phase timeline; latency and goodput metrics
        return msg

"""One client request through the cluster: prefill, then decode, streamed as text.

Lifecycle: `RequestStream(record, ...).run()` is an async generator of GenerateResponse
for a request already admitted (its `RequestRecord` holds a stream slot and its quota
charge). It moves the record through its states:
1. route: placement picks a prefill and a decode worker (or one mixed worker); with
   both, conditional disaggregation (`prefill_site`) may drop the prefill side, and the
   decode worker then prefills the prompt itself (as a mixed worker does, no handle);
2. prefill: the prefill worker returns token 1 and a KvHandle, under its own deadline;
   if the worker is unreachable or misses the deadline, the request is routed again
   excluding it and retried once; token 1 is streamed (TTFT ends here);
3. decode: the decode worker imports the KV and streams the rest; the first decode
   token has its own deadline (it includes the transfer), later tokens an idle deadline;
   a decode worker that refuses the request before its first chunk (no room for the KV:
   RESOURCE_EXHAUSTED, or unreachable: UNAVAILABLE) is swapped for another, or tried
   again after a backoff when all were full, within that first-token deadline and the
   KV lease (`DecodeRetry`); the prefill worker's lease is still good, so the new
   decode worker pulls from the same handle; an import that finds the KV gone
   (NOT_FOUND: the lease ended, or its exporter cannot be reached) has the same decode
   worker compute it instead, once per request (`_reprefill`, not a move);
4. migration: when the decode worker dies or stalls (no token within its deadline)
   after tokens went out, the decode side is placed again, excluding it, and the new
   worker gets the prompt and every token streamed so far (`resume_token_ids`): it
   computes their KV and goes on after them, so the client sees neither an error nor a
   repeated or missing token (greedy and seeded streams continue exactly; see
   `engine.LLMEngine._resume`). At most `max_migrations` times per request, for n = 1;
   then, or with no decode worker left, the stream ends with the lost worker's status;
5. the last message carries usage and the finish reason (and the trace id and phase
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
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import replace

import grpc

from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, gateway_pb2, worker_pb2
from services.common import adapter_proto, priority_proto, sampling
from services.common.detokenizer import IncrementalDetokenizer
from services.common.log_format import log_context
from services.common.metrics import NO_MODEL
from services.common.status import NoWorkerError, StatusError
from services.gateway.config import GatewayConfig
from services.gateway.flow.prefill_site import PrefillSite, SitePolicy
from services.gateway.stream.decode_retry import REFUSALS, DecodeRefusal, DecodeRetry
from services.gateway.stream.request_record import RequestRecord
from services.gateway.stream.stop_text import StopTrimmer
from services.gateway.stream.telemetry import GatewayTelemetry, MigrationOutcome, PromptKvSource
from services.gateway.stream.worker_stubs import WorkerStubs
from services.router.placement import RouteDecision

log = logging.getLogger(__name__)

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
#: A prefill worker may also be out of something another has: a free LoRA adapter slot
#: (AdaptersBusyError) when the request's adapter is loaded nowhere with room.
PREFILL_RETRYABLE = (*RETRYABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class StreamError(StatusError):
    """Ends the client's stream with this gRPC status (a worker's, or a deadline)."""


class WorkerLost(StreamError):
    """The decode worker died (UNAVAILABLE, or its stream ended early) or sent no token
    within its deadline. After tokens went out, another decode worker may take the
    stream over (`RequestStream._migrate`); otherwise the stream ends with this status."""


class KvLost(StreamError):
    """The decode worker could not import the prefilled KV before its first chunk
    (NOT_FOUND: the lease ended before or during the read, or the prefill worker
    restarted): the bytes were discarded, and the same decode worker may prefill the
    prompt itself (`RequestStream._reprefill`)."""


class DecodeRefused(StreamError):
    """A decode worker refused the request before its first chunk (`REFUSALS`): another
    attempt may take it over. Ends the stream with its status when none can."""

    def __init__(self, code: grpc.StatusCode, message: str, refusal: DecodeRefusal) -> None:
        super().__init__(code, message)
        self.refusal = refusal


def deadline_error(deadline_s: float) -> StreamError:
    return StreamError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"request_deadline_s: the request ran past its {deadline_s:g}s deadline",
    )


class RequestStream:
    def __init__(
        self,
        record: RequestRecord,
        config: GatewayConfig,
        stubs: WorkerStubs,
        detok: IncrementalDetokenizer,
        telemetry: GatewayTelemetry | None = None,
        sites: SitePolicy | None = None,
    ) -> None:
        self.record = record
        self.sites = sites or SitePolicy(0, 0.0)
        self.req = record.req
        self.config = config
        self.stubs = stubs
        # Each fork (n > 1) has its own text: detokenizer and stop trimmer, by index.
        self.texts: dict[int, tuple[IncrementalDetokenizer, StopTrimmer]] = {}
        self.detok = detok
        self.open_forks = self.req.params.n  # the stream ends when each fork has
        self.prompt_sent = False  # prompt_logprobs go on the first message only
        self.cached_tokens = 0
        self.output: list[int] = []  # fork 0's tokens streamed so far (what a move resumes)
        self.lost: list[str] = []  # decode workers the stream moved away from
        self.reprefills = 0  # times a decode worker prefilled again after the KV was lost
        self.tel = (telemetry or GatewayTelemetry.disabled()).stream(
            self.req.request_id,
            self.req.tenant,
            len(self.req.prompt),
            self.req.priority,
            self.req.model or NO_MODEL,
        )
        self.priority = priority_proto.to_proto(self.req.priority)

    def _left(self) -> float:
        """Seconds left before the request's deadline; DEADLINE_EXCEEDED once none are."""
        left = self.req.deadline - time.monotonic()
        if left <= 0:
            raise deadline_error(self.config.request_deadline_s)
        return left

    def _past_deadline(self) -> bool:
        return time.monotonic() >= self.req.deadline

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
                [first.first_token_id], prefill=decision, logprobs=lps[:1],
                prompt_logprobs=first.prompt_logprobs,
            )  # fmt: skip
            for index, token in enumerate(first.fork_token_ids, start=1):
                yield self._delta([token], index=index, logprobs=lps[index : index + 1])
            if first.finished:
                yield self._final(first.finish_reason)
                return
            async for msg in self._decode_with_retry(decision, first.kv_handle):
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
            self.tel.end()

    # -- prefill -----------------------------------------------------------------
    async def _prefill_with_retry(self) -> tuple[RouteDecision, worker_pb2.PrefillResponse | None]:
        failed: list[str] = []
        for attempt in range(self.config.prefill_retries + 1):
            decision = await self.tel.route(self.record.route(failed), attempt)
            if decision.prefill is None:
                return decision, None
            if self._prefill_locally(decision):
                return self.record.skip_prefill(decision), None
            try:
                return decision, await self._prefill(decision)
            except grpc.aio.AioRpcError as exc:
                if self._past_deadline():  # no time left to retry in
                    raise deadline_error(self.config.request_deadline_s) from exc
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self.record.report_down(decision.prefill.worker_id)
                if exc.code() not in PREFILL_RETRYABLE or attempt == self.config.prefill_retries:
                    raise StreamError(
                        exc.code(), f"prefill worker {decision.prefill.worker_id}: {exc.details()}"
                    ) from exc
                failed.append(decision.prefill.worker_id)
        raise AssertionError("unreachable")

    def _prefill_locally(self, decision: RouteDecision) -> bool:
        """Conditional disaggregation (`prefill_site`): whether the decode worker should
        prefill this prompt itself; the choice is traced and counted."""
        assert decision.prefill is not None
        choice = self.sites.choose(
            len(self.req.prompt), decision.decode_cached_tokens,
            decision.prefill.worker_id, decision.decode.worker_id,
        )  # fmt: skip
        self.tel.disaggregation(choice)
        return choice.site is PrefillSite.LOCAL

    async def _prefill(self, decision: RouteDecision) -> worker_pb2.PrefillResponse:
        response = await self._prefill_call(decision, self.req.params)
        self.cached_tokens = response.cached_tokens
        self.tel.add_phases(response.phases)
        return response

    def _adapter(self) -> common_pb2.Adapter | None:
        """The request's LoRA adapter, as each worker call names it (None: the model)."""
        adapter = self.req.adapter
        return None if adapter is None else adapter_proto.to_proto(adapter)

    async def _prefill_call(
        self, decision: RouteDecision, params: SamplingParams
    ) -> worker_pb2.PrefillResponse:
        """One Prefill call to `decision`'s prefill worker; the record knows that worker
        may hold the request's KV under a lease from now on."""
        assert decision.prefill is not None
        request = worker_pb2.PrefillRequest(
            request_id=self.req.worker_request_id, prompt_token_ids=self.req.prompt,
            sampling=sampling.to_proto(params), cache_salt=self.req.tenant,
            priority=self.priority, adapter=self._adapter(),
        )  # fmt: skip
        address = decision.prefill.address
        timeout = min(self.config.prefill_timeout_s, self._left())
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
        """Decode on `decision`'s decode worker, or on another when it refuses the
        request before its first chunk (nothing was yielded then)."""
        retry = DecodeRetry.start(
            self.config.first_token_timeout_s, handle, time.monotonic(), time.time()
        )
        resume: list[int] = []
        while True:
            try:
                async for msg in self._decode(decision, handle, retry.first_token_deadline, resume):
                    yield msg
                return
            except DecodeRefused as refused:
                if refused.refusal is DecodeRefusal.GONE:
                    self.record.report_down(decision.decode.worker_id)
                retry.refused(decision.decode.worker_id, refused.refusal)
                decision = await self._reroute_decode(decision, retry, refused)
            except (WorkerLost, KvLost) as lost:
                if isinstance(lost, WorkerLost):
                    decision, handle = await self._migrate(decision, lost)
                elif resume:  # a moved stream's import failed: that move recomputes it
                    handle = None
                else:
                    self._reprefill(decision, lost)
                    handle = None
                resume = list(self.output)
                retry = DecodeRetry.start(
                    self.config.first_token_timeout_s, handle, time.monotonic(), time.time()
                )

    def _why_not_migrate(self, *, reprefill: bool = False) -> MigrationOutcome | None:
        """Why a lost stream may not move (or, `reprefill`, have its lost KV computed
        again on the same decode worker), or None if it may."""
        if self.config.max_migrations == 0:
            return MigrationOutcome.LIMIT
        # A re-prefill does not move the stream, so it does not use up a move: a stream
        # whose hand-off lost the KV on a loaded host still survives its worker's death.
        # It happens at most once: after it, the stream has tokens to resume, and a lost
        # import is a moved stream's, recomputed within its move.
        if not reprefill and len(self.lost) >= self.config.max_migrations:
            return MigrationOutcome.LIMIT
        if self.req.params.n > 1:
            return MigrationOutcome.FORKS  # each fork would resume on its own: not done
        if not self.output:
            return MigrationOutcome.NO_TOKENS  # nothing went out: its own errors apply
        return None

    def _move_attrs(self, worker: str, lost: StreamError) -> dict[str, str | int]:
        return {
            "pdserve.migration.from": worker, "pdserve.migration.reason": lost.code.name,
            "pdserve.migration.resumed_tokens": len(self.output),
        }  # fmt: skip

    def _may_move(
        self, start: float, attrs: dict[str, str | int], lost: StreamError, *, reprefill: bool
    ) -> None:
        """Raises `lost` (the refusal traced, counted and logged) when the stream may not
        move, or not prefill again (`reprefill`)."""
        refusal = self._why_not_migrate(reprefill=reprefill)
        if refusal is not None:
            self.tel.migrated(start, attrs, refusal)
            log.warning(
                "request %s: %s; the stream may not %s (%s): it ends with that status",
                self.req.request_id, lost, "prefill again" if reprefill else "move",
                refusal.value,
            )  # fmt: skip
            raise lost

    def _reprefill(self, decision: RouteDecision, lost: KvLost) -> None:
        """The prefilled KV is gone: the same decode worker computes it again, resuming
        after the tokens already sent (once at most, apart from the request's
        `max_migrations` moves; 0 turns both off); raises `lost` when it may not."""
        start, attrs = time.monotonic(), self._move_attrs(decision.decode.worker_id, lost)
        attrs["pdserve.migration.to"] = decision.decode.worker_id
        self._may_move(start, attrs, lost, reprefill=True)
        self.reprefills += 1
        self.tel.migrated(start, attrs, MigrationOutcome.REPREFILL)
        log.warning(
            "request %s: the prefilled KV was lost before decode (%s); decode worker %s "
            "prefills it again", self.req.request_id, lost, decision.decode.worker_id,
        )  # fmt: skip

    async def _migrate(
        self, lost_on: RouteDecision, lost: WorkerLost
    ) -> tuple[RouteDecision, common_pb2.KvHandle | None]:
        """Place the decode side again after `lost_on`'s decode worker was lost mid-stream,
        with a handle on the prompt's KV when a prefill worker exports it again
        (`_export_again`); raises `lost` when the stream may not move or no decode worker
        is left."""
        worker = lost_on.decode.worker_id
        start, attrs = time.monotonic(), self._move_attrs(worker, lost)
        if lost.code == grpc.StatusCode.UNAVAILABLE:
            self.record.report_down(worker)  # dead, not slow: every gateway skips it now
        self._may_move(start, attrs, lost, reprefill=False)
        self.lost.append(worker)
        self.record.decode_lost()
        try:
            call = self.record.reroute_decode(lost_on, self.lost)
            decision = await self.tel.route(call, len(self.lost))
        except NoWorkerError:
            self.tel.migrated(start, attrs, MigrationOutcome.NO_WORKER)
            raise lost from None
        attrs["pdserve.migration.to"] = decision.decode.worker_id
        handle = await self._export_again(decision)
        source = PromptKvSource.RECOMPUTED if handle is None else PromptKvSource.IMPORTED
        self.tel.migrated(start, attrs, MigrationOutcome.MOVED, source)
        log.warning(
            "request %s: decode worker %s lost after %d tokens (%s); the stream moves to %s "
            "(prompt KV %s)", self.req.request_id, worker, len(self.output), lost,
            decision.decode.worker_id, source.value,
        )  # fmt: skip
        return decision, handle

    async def _export_again(self, decision: RouteDecision) -> common_pb2.KvHandle | None:
        """A handle on the prompt's KV for a moved stream: the prefill worker that
        prefilled it most likely still caches its full blocks (and the router placed the
        same prompt there again), so a Prefill there computes little more than the last
        partial block and leases the blocks out afresh; the new decode worker imports
        them and computes only the tokens streamed so far. None, and the new worker
        computes the prompt too, when the request had no prefill hop, its prompt is one
        conditional disaggregation prefills locally, or that Prefill fails."""
        if decision.prefill is None:
            return None
        choice = self.sites.choose(
            len(self.req.prompt), decision.decode_cached_tokens,
            decision.prefill.worker_id, decision.decode.worker_id,
        )  # fmt: skip
        if choice.site is PrefillSite.LOCAL:
            return None
        params = replace(self.req.params, prompt_logprobs=None)  # they went out already
        try:
            response = await self._prefill_call(decision, params)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.record.report_down(decision.prefill.worker_id)
            log.warning(
                "request %s: prefill worker %s did not export the prompt's KV again (%s: "
                "%s); the new decode worker computes it", self.req.request_id,
                decision.prefill.worker_id, exc.code().name, exc.details(),
            )  # fmt: skip
            return None
        # Its first draw ended it there (an unseeded sample may differ from the stream's):
        # no KV was kept, and the stream's own tokens decide what happens next.
        return None if response.finished else response.kv_handle

    async def _reroute_decode(
        self, failed: RouteDecision, retry: DecodeRetry, refused: DecodeRefused
    ) -> RouteDecision:
        """The next decode worker to try; raises once retrying is over: past a deadline,
        or with no worker left that may take the request (then `refused` itself)."""
        while True:
            now = time.monotonic()
            if self._past_deadline():
                raise deadline_error(self.config.request_deadline_s) from refused
            if not retry.open(now):
                message = retry.window_message(str(refused))
                raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, message) from refused
            try:
                call = self.record.reroute_decode(failed, retry.exclude() + self.lost)
                return await self.tel.route(call, retry.attempts)
            except NoWorkerError:
                if not retry.can_wait():
                    raise refused from None
            # Every worker left was full: give them a moment to free blocks, then again.
            await asyncio.sleep(min(retry.backoff(now), self._left()))
            retry.retry_full()

    async def _decode(
        self,
        decision: RouteDecision,
        handle: common_pb2.KvHandle | None,
        first_by: float,
        resume: Sequence[int] = (),
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """One Decode call; DecodeRefused when it fails before its first chunk with a
        status another attempt may cure, WorkerLost when the worker dies or stalls. Its
        first chunk is due by `first_by`. `resume`: the tokens a migrated stream already
        sent (the prompt's log-probabilities went out with them)."""
        params = replace(self.req.params, prompt_logprobs=None) if resume else self.req.params
        request = worker_pb2.DecodeRequest(
            request_id=self.req.worker_request_id, prompt_token_ids=self.req.prompt,
            sampling=sampling.to_proto(params), cache_salt=self.req.tenant,
            priority=self.priority, resume_token_ids=resume, adapter=self._adapter(),
        )  # fmt: skip
        if handle is not None:
            request.kv_handle.CopyFrom(handle)
        call = self.stubs[decision.decode.address].Decode(
            request, timeout=self._left(), metadata=self.tel.metadata()
        )
        self.record.decode_opened(call)
        pulled_from = decision.prefill.address if decision.prefill and handle else None
        chunk = await self._first_chunk(call, first_by, decision, imported=handle is not None)
        # Any chunk comes after the import: the decode worker has the KV now.
        self.record.decode_started(pulled_from)
        first = handle is None and not resume  # a mixed request's prefill is here
        while True:
            if first and chunk.cached_tokens:
                self.cached_tokens = chunk.cached_tokens
            if chunk.phases:
                self.tel.add_phases(chunk.phases)
            if chunk.token_ids:
                yield self._delta(
                    list(chunk.token_ids), prefill=decision if first else None, decode=decision,
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
            if imported and exc.code == grpc.StatusCode.NOT_FOUND:
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
        wait = max(0.0, min(timeout, self._left()))
        try:
            chunk = await asyncio.wait_for(call.read(), wait)
        except TimeoutError as exc:
            if self._past_deadline():
                raise deadline_error(self.config.request_deadline_s) from exc
            raise WorkerLost(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"decode worker {worker} sent no token "
                + (f"within {limit}" if limit else f"for {timeout:.1f}s"),
            ) from exc
        except grpc.aio.AioRpcError as exc:
            self.record.decode_ended()
            if self._past_deadline():  # the call's own deadline: the request's
                raise deadline_error(self.config.request_deadline_s) from exc
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
        prefill: RouteDecision | None = None,
        decode: RouteDecision | None = None,
        logprobs: Sequence[common_pb2.TokenLogprobs] = (),
        prompt_logprobs: Sequence[common_pb2.TokenLogprobs] = (),
        index: int = 0,
    ) -> gateway_pb2.GenerateResponse:
        self.record.generated(len(tokens))
        self.tel.on_tokens(len(tokens))
        if index == 0:
            self.output += tokens
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
        if prefill is not None:
            msg.prefill_worker = (
                prefill.prefill.worker_id if prefill.prefill else prefill.decode.worker_id
            )
        if decode is not None:
            msg.decode_worker = decode.decode.worker_id
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
                prompt_tokens=len(self.req.prompt), cached_tokens=self.cached_tokens,
                completion_tokens=self.record.completion_tokens,
            )
        )  # fmt: skip
        self.tel.finish(msg)  # trace id and phase timeline; latency and goodput metrics
        return msg

"""A stream's recovery policy: what happens when a Decode call fails it.

Lifecycle: each `RequestStream` makes one `StreamRecovery` and decodes through its
`DecodeAttempt`s, `first(decision, handle)` first (its first-chunk window, `DecodeRetry`,
opens with the first Decode call). The stream reports each token of fork 0 it sends
(`sent`: what a move resumes after). When a call fails, the stream hands the error over
and gets the next attempt back, or the error that ends the stream:
- `after_refusal` (`DecodeRefused`: a decode worker refused the request before its
  first chunk: no room for the KV, RESOURCE_EXHAUSTED, or unreachable, UNAVAILABLE):
  the decode side is placed again, excluding the workers that refused (an unreachable
  one is reported down), or the same ones again after a backoff when all were full,
  within the first-token deadline and the KV lease; the prefill worker's lease is still
  good, so the new decode worker pulls from the same handle (decode reroute);
- `after_loss` with `KvLost` (the import found the KV gone, NOT_FOUND: the lease ended,
  or its exporter cannot be reached; or corrupt, DATA_LOSS: blocks failed their checksum
  on a read and a re-read): the same decode worker computes it instead, once
  per request (re-prefill, not a move); a moved stream's lost import is recomputed
  within its move;
- `after_loss` with `WorkerLost` (the decode worker died or stalled after tokens went
  out): the decode side is placed again, excluding it, and the new worker gets the
  prompt and every token streamed so far (`resume_token_ids`), with a handle on the
  prompt's KV when a prefill worker exports it again: it computes the rest of their KV
  and goes on after them, so the client sees neither an error nor a repeated or missing
  token (greedy and seeded streams continue exactly; see `engine.intake._resume`).
  At most `max_migrations` moves per request, for n = 1; then, or with no decode worker
  left, the stream ends with the lost worker's status (migration).
Each move, re-prefill, or refusal of either is a `migration` phase and span, counted by
outcome, and logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import grpc

from engine.request_spec import RequestSpec
from pdserve.v1 import common_pb2, worker_pb2
from services.common.status import NoWorkerError
from services.gateway.config import GatewayConfig
from services.gateway.flow.prefill_site import PrefillSite, SitePolicy
from services.gateway.stream.decode_retry import DecodeRefusal, DecodeRetry
from services.gateway.stream.errors import (
    Deadline,
    DecodeRefused,
    KvLost,
    StreamError,
    WorkerLost,
)
from services.gateway.stream.request_record import RequestRecord
from services.gateway.stream.telemetry import MigrationOutcome, PromptKvSource, StreamTelemetry
from services.router.placement import RouteDecision

log = logging.getLogger(__name__)

#: One Prefill call to a decision's prefill worker, with these sampling parameters (the
#: stream's own: the record learns of the lease it may leave there).
PrefillCall = Callable[[RouteDecision, RequestSpec], Awaitable[worker_pb2.PrefillResponse]]


@dataclass
class DecodeAttempt:
    """One Decode call to make: on `decision`'s decode worker, importing `handle` (None:
    the worker computes the prompt), resuming after `resume` (the tokens a moved stream
    already sent), its first chunk due within `retry`'s window."""

    decision: RouteDecision
    handle: common_pb2.KvHandle | None
    retry: DecodeRetry
    resume: list[int] = field(default_factory=list)


class StreamRecovery:
    def __init__(
        self,
        record: RequestRecord,
        config: GatewayConfig,
        tel: StreamTelemetry,
        sites: SitePolicy,
        prefill: PrefillCall,
    ) -> None:
        self.record = record
        self.req = record.req
        self.config = config
        self.tel = tel
        self.sites = sites
        self.prefill = prefill
        self.deadline = Deadline(self.req.deadline, config.request_deadline_s)
        self.output: list[int] = []  # fork 0's tokens streamed so far (what a move resumes)
        self.lost: list[str] = []  # decode workers the stream moved away from
        self.reprefills = 0  # times a decode worker prefilled again after the KV was lost

    def first(self, decision: RouteDecision, handle: common_pb2.KvHandle | None) -> DecodeAttempt:
        """The stream's first Decode call, on `decision`'s decode worker."""
        return self._attempt(decision, handle, [])

    def _attempt(
        self, decision: RouteDecision, handle: common_pb2.KvHandle | None, resume: list[int]
    ) -> DecodeAttempt:
        retry = DecodeRetry.start(
            self.config.first_token_timeout_s, handle, time.monotonic(), time.time()
        )
        return DecodeAttempt(decision, handle, retry, resume)

    def sent(self, tokens: list[int]) -> None:
        """Fork 0's `tokens` went out to the client."""
        self.output += tokens

    async def after_refusal(self, attempt: DecodeAttempt, refused: DecodeRefused) -> DecodeAttempt:
        """The attempt after `attempt`'s decode worker refused the request before its
        first chunk (nothing was yielded then): another decode worker, in the same
        first-token window."""
        if refused.refusal is DecodeRefusal.GONE:
            self.record.report_down(attempt.decision.decode.worker_id)
        attempt.retry.refused(attempt.decision.decode.worker_id, refused.refusal)
        decision = await self._reroute_decode(attempt.decision, attempt.retry, refused)
        return replace(attempt, decision=decision)

    async def after_loss(self, attempt: DecodeAttempt, lost: WorkerLost | KvLost) -> DecodeAttempt:
        """The attempt after `attempt` lost its decode worker (a move) or the prompt's KV
        (a re-prefill), resuming after every token sent so far; raises `lost` when the
        stream may not go on."""
        decision, handle = attempt.decision, attempt.handle
        if isinstance(lost, WorkerLost):
            decision, handle = await self._migrate(decision, lost)
        elif attempt.resume:  # a moved stream's import failed: that move recomputes it
            handle = None
        else:
            self._reprefill(decision, lost)
            handle = None
        return self._attempt(decision, handle, list(self.output))

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
        choice = self.sites.prefill_site(
            len(self.req.prompt), decision.decode_cached_tokens,
            decision.prefill.worker_id, decision.decode.worker_id,
        )  # fmt: skip
        if choice.site is PrefillSite.LOCAL:
            return None
        try:
            response = await self.prefill(decision, self.req.later_spec())
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
            if self.deadline.passed():
                raise self.deadline.error() from refused
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
            await asyncio.sleep(min(retry.backoff(now), self.deadline.left()))
            retry.retry_full()

"""One gateway request's record: what it holds, where it is, and its one cleanup.

Lifecycle (`RequestState`), driven by `GatewayService.stream` and `RequestStream`:

    ADMITTING   `charge` charges the tenant's quota (or refuses: QuotaExceeded), `admit`
                waits for admission control's pass (or refuses: Overloaded), then
                `take_slot` takes a stream slot (or refuses: StreamCapReached)
    ROUTING     `route`: the placement picks workers and leases their load; a prefill
                that failed on an unreachable worker routes again, excluding it;
                `skip_prefill` drops the prefill side when the decode worker is to
                prefill the prompt itself (its load lease goes back at once), and
                `serve_on_prefill` the decode side when the prefill worker is to run
                the request whole (elastic roles);
                `reroute_decode` (from DECODING) places the decode side again when a
                decode worker refused the request before its first chunk, or died or
                stalled after it (`decode_lost` first: the stream migrates)
    PREFILLING  `prefill_sent` before the Prefill call (from then on the prefill worker
                may hold the request's KV under a lease for the decode worker to pull);
                `prefill_done` drops it when the request already ended there
    DECODING    `decode_opened(call)`; `decode_started` on the first chunk (the decode
                worker has pulled the KV: the prefill lease is its business now);
                `decode_ended` when the stream ends by itself
    FINISHED    the last message is made; the client has yet to take it
    CLEANING    `close()`: the one cleanup path, from any state above; called when the
                client's stream ends however it ends, and earlier by the request's
                `StreamBuffer` when the relay fails (a worker's error, the request's
                deadline) or the client stopped reading, so both workers drop the
                request at once
    CLOSED      nothing held; the record has left the book; a request that reached a
                worker has its `UsageEntry` in the gateway's usage ledger

`held` is the set of `Resource`s the record holds right now, and the `RecordBook` counts
them over all live records (`pdserve_gateway_held`). `close()` gives back exactly what
is held: it cancels the decode stream and frees the stream slot at once, then, as its
own task, sends Abort to every prefill worker that may keep a lease, releases the load
leases, and refunds the unused quota; it returns a wait on that task, the same task
however often it is called.

Why nothing can be cut short by a cancel, even two in one loop turn: an acquisition that
runs off the event loop (the quota charge and a placement are Redis round trips in a
thread) starts as a future the record holds, and the request's task only waits for it
through `shield`. A cancel of that wait leaves the acquisition running, and the cleanup
waits for it and gives back what it got. The cleanup itself runs in `stubs.cleanups`
(`services.common.detached.Detached`), so no cancel of the request's task reaches it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Awaitable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from pdserve.v1 import worker_pb2
from services.common.status import RefusalReason, StreamCapReached
from services.gateway.access.auth import Principal
from services.gateway.access.gate import Access
from services.gateway.access.quota import Grant
from services.gateway.access.usage_ledger import UsageEntry, UsageLedger, UsageOutcome
from services.gateway.flow.admission import Admission
from services.gateway.flow.capacity import Cost, Pass
from services.gateway.flow.itl_calibration import ItlMeter
from services.gateway.stream.prepared import Prepared
from services.gateway.stream.record_book import RecordBook, Resource
from services.gateway.stream.worker_stubs import WorkerStubs
from services.router.placement import Placement, RouteDecision

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 2.0  # a worker that does not answer by then lets the lease expire
STREAM_CAP_RETRY_S = 1.0  # a stream slot frees when any stream ends: soon, on a busy gateway


class RequestState(enum.Enum):
    ADMITTING = "admitting"
    ROUTING = "routing"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    CLEANING = "cleaning"
    CLOSED = "closed"


class Cancellable(Protocol):
    """An open call (grpc.aio's stream calls are)."""

    def cancel(self) -> bool: ...


@dataclass(frozen=True)
class Keepers:
    """Who hands out and takes back each resource; one set per gateway."""

    placement: Placement  # load leases
    access: Access  # quota charges
    stubs: WorkerStubs  # prefill leases (the Abort RPC); cleanups run in its `cleanups`
    book: RecordBook[RequestRecord]  # live records and the counts of what they hold
    ledger: UsageLedger | None = None  # where a served request's usage is written


class RequestRecord:
    def __init__(self, req: Prepared, keepers: Keepers) -> None:
        self.req = req
        self.keepers = keepers
        self.state = RequestState.ADMITTING
        self.completion_tokens = 0  # generated so far: what the quota refund leaves charged
        self.cached_tokens = 0  # prompt tokens a worker served from its prefix cache
        self._reached_worker = False  # a worker was sent its prompt: it has usage to record
        self._finished = False
        self._failed = False
        self._itl: ItlMeter | None = None  # times its tokens against the predicted step
        self._slot = False
        self._pass: Pass | None = None
        self._served = False  # it reached a worker: its prompt tokens count in the quota
        self._charge: asyncio.Future[Grant] | None = None
        self._placements: list[asyncio.Future[RouteDecision]] = []
        self._prefill: set[str] = set()  # addresses of prefill workers that may hold KV
        self._decode: Cancellable | None = None
        self._closing: asyncio.Task[None] | None = None
        keepers.book.update(self, frozenset())

    @property
    def held(self) -> frozenset[Resource]:
        held = set[Resource]()
        if self._pass is not None:
            held.add(Resource.ADMISSION)
        if self._slot:
            held.add(Resource.STREAM_SLOT)
        if self._charge is not None:
            held.add(Resource.QUOTA_CHARGE)
        if self._placements:
            held.add(Resource.LOAD_LEASE)
        if self._prefill:
            held.add(Resource.PREFILL_LEASE)
        if self._decode is not None:
            held.add(Resource.DECODE_STREAM)
        return frozenset(held)

    @property
    def served(self) -> bool:
        """Whether it reached routing: from then on its prompt counts against the quota."""
        return self._served

    def _changed(self) -> None:
        if self.state is not RequestState.CLOSED:
            self.keepers.book.update(self, self.held)

    def _enter(self, state: RequestState) -> None:
        if self._closing is not None:
            # Nothing is acquired once the cleanup has begun: it would never be released.
            raise RuntimeError(f"request {self.req.request_id} is {self.state.value}")
        self.state = state

    # -- admission -----------------------------------------------------------------
    def take_slot(self, max_streams: int) -> None:
        """Take one of `max_streams` stream slots, or raise StreamCapReached."""
        self._enter(RequestState.ADMITTING)
        if self.keepers.book.count(Resource.STREAM_SLOT) >= max_streams:
            raise StreamCapReached(
                f"max_streams: {max_streams} streams already running; retry in 1s",
                RefusalReason.STREAM_CAP,
                STREAM_CAP_RETRY_S,
            )
        self._slot = True
        self._changed()

    async def admit(self, admission: Admission) -> None:
        """Wait for admission control to let the request start; raises Overloaded. The
        pass it gets counts against capacity until `decode_started` or the cleanup."""
        self._enter(RequestState.ADMITTING)
        req = self.req
        # n forks share the prompt's KV; each may write max_tokens of its own.
        cost = Cost(len(req.prompt), req.params.max_tokens * req.params.n)
        self._pass = await admission.admit(req.priority, req.tenant, req.weight, cost)
        self._itl = admission.capacity.itl_meter(self._pass)
        self._changed()

    def _sent(self) -> None:
        """Its prompt is in a worker's queue: that worker's next signal counts it."""
        self._reached_worker = True
        if self._pass is not None and self._pass.sent is None:
            self._pass.sent = time.monotonic()

    def _settle_pass(self) -> None:
        if self._pass is not None:
            if self._pass.first_token is None and self.state is RequestState.DECODING:
                self._pass.first_token = time.monotonic()  # a mixed worker's first token
            self._pass.settled = True
            self._pass = None
            self._changed()

    def kv_blocks(self, block_size: int) -> int:
        """KV blocks the request holds on a worker now (0 before prefill, after close)."""
        if self.state not in (RequestState.PREFILLING, RequestState.DECODING):
            return 0
        return math.ceil((len(self.req.prompt) + self.completion_tokens) / block_size)

    async def charge(self, principal: Principal) -> None:
        """Charge prompt + max_tokens to the tenant's quota; raises QuotaExceeded."""
        self._enter(RequestState.ADMITTING)
        params = self.req.params
        most = params.max_tokens * params.n  # every fork may write max_tokens
        self._charge = self.keepers.access.admit(principal, len(self.req.prompt), most)
        self._charge.add_done_callback(self._charged)
        self._changed()
        await asyncio.shield(self._charge)

    def _charged(self, charging: asyncio.Future[Grant]) -> None:
        failed = charging.cancelled() or charging.exception() is not None
        if failed or not charging.result().window_key:  # refused, or not metered
            self._charge = None
            self._changed()

    # -- routing -------------------------------------------------------------------
    async def route(self, exclude: Sequence[str]) -> RouteDecision:
        """Pick workers (excluding the ids in `exclude`) and lease their load; raises
        NoWorkerError. The placement is the record's from its start."""
        self._enter(RequestState.ROUTING)
        self._served = True
        query = self.req.route_query().excluding(exclude)
        placing = asyncio.ensure_future(self.keepers.placement.route(query))
        self._placements.append(placing)
        placing.add_done_callback(self._placed)
        self._changed()
        return await asyncio.shield(placing)

    def _placed(self, placing: asyncio.Future[RouteDecision]) -> None:
        failed = placing.cancelled() or placing.exception() is not None
        if failed or not placing.result().load_lease_ids:  # nothing leased: nothing to give
            self._placements.remove(placing)
            self._changed()

    # -- prefill -------------------------------------------------------------------
    def prefill_sent(self, address: str) -> None:
        """Before the Prefill call to `address`: from now on that worker may keep the
        request's KV under a lease until a decode worker pulls it."""
        self._enter(RequestState.PREFILLING)
        self._sent()
        self._prefill.add(address)
        self._changed()

    def prefill_done(self, address: str, *, finished: bool) -> None:
        """The Prefill call answered; `finished`: the request ended there, and the
        worker released its KV itself."""
        if self._pass is not None:
            self._pass.first_token = time.monotonic()  # calibrates admission's estimate
        if finished:
            self._prefill.discard(address)
            self._changed()

    # -- decode --------------------------------------------------------------------
    async def reroute_decode(self, failed: RouteDecision, exclude: Sequence[str]) -> RouteDecision:
        """Place the decode side again (excluding the ids in `exclude`) for a request
        whose decode worker, `failed.decode`, refused it before its first chunk; the
        prefill worker keeps the KV and its load lease. Once placed, the refused worker's
        load lease is given back; NoWorkerError keeps it (the request may come back)."""
        self._enter(RequestState.ROUTING)
        query = replace(self.req.route_query(), exclude=tuple(exclude), prefill=failed.prefill)
        placing = asyncio.ensure_future(self.keepers.placement.route_decode(query))
        self._placements.append(placing)
        placing.add_done_callback(self._placed)
        self._changed()
        decision = await asyncio.shield(placing)
        # Keep the prefill worker's load lease, give back the refused decode one's.
        self._split(failed, keep=failed.prefill_load(), give_back=failed.decode_load())
        return decision

    def skip_prefill(self, decision: RouteDecision) -> RouteDecision:
        """The decode worker prefills the request itself (conditional disaggregation):
        the prefill worker's load lease goes back now; returns the decode-only decision."""
        local = decision.without_prefill()
        self._split(decision, keep=local, give_back=decision.prefill_load())
        return local

    def serve_on_prefill(self, decision: RouteDecision) -> RouteDecision:
        """The prefill worker runs the request whole (elastic roles): the decode worker's
        load lease goes back now; returns the decision naming the prefill worker alone."""
        whole = decision.on_prefill_worker()
        self._split(decision, keep=whole, give_back=decision.decode_load())
        return whole

    def _split(self, held: RouteDecision, *, keep: RouteDecision, give_back: RouteDecision) -> None:
        """Replace the placement `held` by `keep`'s leases and release `give_back`'s."""
        loop = asyncio.get_running_loop()
        for placing in [p for p in self._placements if p.done() and not p.cancelled()]:
            if placing.exception() is None and placing.result() is held:
                self._placements.remove(placing)
                if keep.load_lease_ids:
                    kept: asyncio.Future[RouteDecision] = loop.create_future()
                    kept.set_result(keep)
                    self._placements.append(kept)
                gone: asyncio.Future[RouteDecision] = loop.create_future()
                gone.set_result(give_back)
                self.keepers.stubs.cleanups.start(self._release_load(gone))
        self._changed()

    def report_down(self, worker_id: str) -> None:
        """A call to `worker_id` failed UNAVAILABLE: tell the placement (every gateway's
        router then skips it at once). Runs on its own, like the cleanup."""
        self.keepers.stubs.cleanups.start(_awaited(self.keepers.placement.report_down(worker_id)))

    def decode_opened(self, call: Cancellable, *, local: bool = False) -> None:
        """The Decode call is open; `local`: that worker prefills the prompt itself (a
        mixed worker, or conditional disaggregation), so its signals count the request
        from now on."""
        self._enter(RequestState.DECODING)
        self._sent()  # a mixed worker prefills it here
        if local and self._pass is not None and self._pass.decode_at is None:
            self._pass.decode_at = time.monotonic()
        self._decode = call
        self._changed()

    def decode_started(self, prefill_address: str | None) -> None:
        """The first chunk came: the decode worker has pulled the KV (an import runs
        before any chunk), and released that prefill worker's lease. The decode worker
        reports the request's blocks itself from now on: its admission pass is settled."""
        if self._pass is not None and self._pass.decode_at is None:
            self._pass.decode_at = time.monotonic()  # in the decode worker's batch now
        self._settle_pass()
        if prefill_address is not None:
            self._prefill.discard(prefill_address)
            self._changed()

    def decode_lost(self) -> None:
        """The decode worker died or stalled mid-stream: cancel the call (a stalled worker
        that comes back aborts the request) before the stream moves elsewhere."""
        if self._decode is not None:
            self._decode.cancel()
        self.decode_ended()

    def decode_ended(self) -> None:
        """The decode stream ended by itself (last chunk, or an error): nothing to cancel."""
        self._decode = None
        self._changed()

    def generated(self, tokens: int) -> None:
        """Count tokens handed towards the client, until the cleanup begins: the quota
        refund settles on this count, so a token the relay makes while the request is
        being closed (a cancel racing a worker's answer) is neither billed nor counted."""
        if self._closing is None:
            self.completion_tokens += tokens
            if self._itl is not None:
                self._itl.took(tokens)

    def finished(self) -> None:
        self._enter(RequestState.FINISHED)
        self._finished = True
        if self._itl is not None:
            self._itl.report()

    def failed(self) -> None:
        """An error status ends the stream (its usage entry says so)."""
        self._failed = True

    @property
    def outcome(self) -> UsageOutcome:
        """How the request ended: finished, failed, or else cancelled by its client."""
        if self._finished:
            return UsageOutcome.FINISHED
        return UsageOutcome.FAILED if self._failed else UsageOutcome.CANCELLED

    def usage_entry(self) -> UsageEntry:
        """What the request used: the `usage` its last message carries (or would have)."""
        req = self.req
        return UsageEntry(
            tenant=req.tenant, model=req.model, adapter=req.adapter.name if req.adapter else "",
            priority=req.priority.label, outcome=self.outcome,
            prompt_tokens=len(req.prompt), cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens, request_id=req.request_id,
            ended_ms=int(time.time() * 1000),
        )  # fmt: skip

    # -- the one cleanup path ------------------------------------------------------
    def close(self) -> Awaitable[None]:
        """Give back everything held. Safe to call from any state, any number of times:
        every call returns a wait on the same cleanup, and cancelling a wait does not
        cancel the cleanup."""
        if self._closing is None:
            self.state = RequestState.CLEANING
            if self._decode is not None:
                self._decode.cancel()  # the decode worker aborts the request
                self._decode = None
            self._slot = False
            self._settle_pass()
            self._changed()
            self._closing = self.keepers.stubs.cleanups.start(self._release())
        return asyncio.shield(self._closing)

    async def _release(self) -> None:
        """Abort, release and refund together; each waits for its acquisition first."""
        steps: list[Coroutine[Any, Any, None]] = [self._abort_prefill(), self._refund()]
        steps += [self._release_load(placing) for placing in list(self._placements)]
        try:
            for result in await asyncio.gather(*steps, return_exceptions=True):
                if isinstance(result, BaseException):
                    log.warning("request %s: cleanup step failed: %r", self.req.request_id, result)
        finally:
            self.state = RequestState.CLOSED
            self.keepers.book.forget(self)
            if self._reached_worker and self.keepers.ledger is not None:
                self.keepers.ledger.add(self.usage_entry())

    async def _abort_prefill(self) -> None:
        # Every worker that may keep the KV: a prefill that timed out may have exported
        # it as the deadline hit. An Abort that fails means the worker is gone or stuck;
        # its lease then expires on its own.
        request = worker_pb2.AbortRequest(request_id=self.req.worker_request_id)
        stubs = self.keepers.stubs
        calls = [
            stubs[address].Abort(request, timeout=ABORT_TIMEOUT_S) for address in self._prefill
        ]
        await asyncio.gather(*calls, return_exceptions=True)
        self._prefill.clear()
        self._changed()

    async def _refund(self) -> None:
        charging = self._charge
        if charging is None:
            return
        try:
            grant = await charging  # the charge may still be on its way to Redis
        except Exception:
            grant = None  # refused: nothing charged
        if grant is not None:
            await self.keepers.access.settle(grant, self.completion_tokens, served=self._served)
        self._charge = None
        self._changed()

    async def _release_load(self, placing: asyncio.Future[RouteDecision]) -> None:
        try:
            decision = await placing  # a placement still in its thread leases on its own
        except Exception:
            decision = None  # no decision: no lease
        if decision is not None:
            await self.keepers.placement.release(decision)
        if placing in self._placements:
            self._placements.remove(placing)
            self._changed()


async def _awaited(work: Awaitable[None]) -> None:
    await work

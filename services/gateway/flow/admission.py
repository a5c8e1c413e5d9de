"""Admission control: a request starts only when the cluster can give it its first token
within its class's TTFT budget (or, for a prompt whose prefill alone takes most of the
budget, start it within a tenth of it); otherwise it waits, for at most that budget, or
is refused at once.

Lifecycle: the gateway makes one `Admission` and `start`s its tick task with the event
loop. `admit(record)` runs after the quota charge and before anything reaches a worker:
- the fast path: nobody of its class or higher is waiting, its tenant is not over its
  cluster-wide share, and `Capacity` says it fits (its prefill done within 90% of
  the budget, or for a prompt whose prefill alone takes most of the budget, started
  within a tenth of it; its start delay within `QUEUE_TARGET_S` of an idle pool's;
  decode KV room): it is admitted at once;
- else it takes a `Ticket` in the `WaitingRoom`. A full room refuses the lowest class
  first (a newcomer displaces the newest ticket of a lower class, or is refused itself),
  at once (UNAVAILABLE / 503, `Overloaded` with a retry hint);
- every tick (`TICK_S`, or sooner when something changed) the task refreshes the
  workers' signals from Redis, settles the fair-share ledger, refuses the tickets that
  waited their whole budget (`RefusalReason.BUDGET`), and starts tickets in the room's
  order (class, then DRR among tenants) while they fit.
An admitted request holds a `Pass` until its KV reaches a decode worker or it ends
(`RequestRecord` settles it): until then it counts against capacity here, since the
workers' signals have not seen it yet. A request cancelled while it waits leaves the
room; one admitted in the same instant settles its pass, so nothing is left counted.

Without signals (static placement, no Redis, or Redis down) every request is admitted,
as before: the engines' queues and the request deadline still bound the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.priority import Priority
from services.common.role import Role
from services.common.status import Overloaded, RefusalReason
from services.gateway.config import GatewayConfig
from services.gateway.flow.admission_metrics import AdmissionMetrics
from services.gateway.flow.capacity import Capacity, Cost, Pass
from services.gateway.flow.fair_share import FairShare, FairView
from services.gateway.flow.prefill_site import SitePolicy
from services.gateway.flow.waiting_room import Ticket, WaitingRoom
from services.router.redis_client import REDIS_DOWN_ERRORS
from services.router.worker_signal import SignalBoard, WorkerSignal

log = logging.getLogger(__name__)

TICK_S = 0.05  # the longest a ticket waits for capacity it could already have
SIGNAL_REFRESH_S = 0.1  # workers publish every 0.25 s; reading faster buys nothing
FAIR_SYNC_S = 0.25
# A request is let in only if its estimated prefill ends within this share of its budget
# (the estimate is a mean; TTFT has a tail), unless MIN_WAIT_SHARE below lets it in.
HEADROOM = 0.9
# However long its own prefill, a request may wait this share of its budget: a prompt
# an idle pool can start is started, though its prefill alone outlasts the budget.
MIN_WAIT_SHARE = 1 - HEADROOM
# The most a request is let queue in the engines behind others: enough to keep the pool
# busy across a signal's lag, short enough that the backlog waits here, in order.
QUEUE_TARGET_S = 1.0
# Where no worker publishes a speed (workers calibrate before they register, so only
# one that could not) there is no estimate; this many admitted requests may be on their
# way at once, per gateway replica, until there is.
UNMEASURED_PENDING = 8
MAX_RETRY_S = 60.0
# The share of `itl_budget_s` the decode step may reach with a new stream of each class:
# as the decode pool fills, sheddable streams wait first, then standard ones, and the
# rest of the budget is headroom that critical streams may take.
ITL_SHARE = {Priority.CRITICAL: 1.0, Priority.STANDARD: 0.9, Priority.SHEDDABLE: 0.8}


class Admission:
    def __init__(
        self,
        config: GatewayConfig,
        board: SignalBoard | None = None,
        fair: FairShare | None = None,
        metrics: AdmissionMetrics | None = None,
    ) -> None:
        self.config = config
        self.board = board
        self.fair = fair
        self.metrics = metrics or AdmissionMetrics.disabled()
        sites = SitePolicy(
            config.local_prefill_max_tokens, config.local_prefill_busy_s,
            elastic=config.elastic_roles,
        )  # fmt: skip
        self.capacity = Capacity(sites)
        self.room = WaitingRoom(config.waiting_room_size)
        self.view = FairView()
        self.signalled = False  # some signal was read: capacity means something
        self._waiting: dict[Ticket, asyncio.Future[Pass]] = {}
        self._weights: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._first_read = asyncio.Event()  # set once signals were read (or failed to be)
        self._task: asyncio.Task[None] | None = None
        self._signals_at = -math.inf
        self._fair_at = time.monotonic()
        self._usage: Callable[[], Iterable[Usage]] = lambda: ()
        self._warned_slow = False  # logged once: one stream's step is over the ITL budget

    @property
    def enabled(self) -> bool:
        return self.config.admission_control and self.board is not None

    # -- lifecycle -----------------------------------------------------------------
    def start(self, usage: Callable[[], Iterable[Usage]]) -> None:
        """Start ticking; `usage` lists the live requests' KV use (for the ledger)."""
        self._usage = usage
        if self._task is None and self.enabled:
            self._fair_at = time.monotonic()  # charges count from the first tick, not build
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for ticket in list(self._waiting):
            self._refuse(ticket, RefusalReason.BUDGET, "the gateway is shutting down")

    # -- one request ---------------------------------------------------------------
    async def admit(
        self, priority: Priority, tenant: str, weight: float, cost: Cost
    ) -> Pass | None:
        """Wait until the request may start; its `Pass` (None: admission is off).
        Raises Overloaded when it is refused."""
        if not self.enabled:
            return None
        await self._first_read.wait()  # a cold gateway must not let a burst through blind
        self._weights[tenant] = weight
        now = time.monotonic()
        if self._may_pass(priority, tenant) and self._fits(cost, priority, 0.0):
            return self._admitted(priority, cost, 0.0)
        budget = self.config.budget_s(priority)
        charge = self.capacity.kv_block_seconds(cost)
        ticket = Ticket(priority, tenant, weight, charge, now, budget, cost)
        waiting = asyncio.get_running_loop().create_future()
        self._waiting[ticket] = waiting
        refused = self.room.offer(ticket)
        if refused is ticket:
            self._waiting.pop(ticket)
            raise self._overloaded(ticket, RefusalReason.ROOM_FULL)
        if refused is not None:
            self._refuse(refused, RefusalReason.DISPLACED, "a higher class took its place")
        self.metrics.set_waiting(self.room)
        self._wake.set()
        return await self._wait(ticket, waiting)

    async def _wait(self, ticket: Ticket, waiting: asyncio.Future[Pass]) -> Pass:
        try:
            return await waiting
        except asyncio.CancelledError:
            if waiting.done() and not waiting.cancelled() and waiting.exception() is None:
                waiting.result().settled = True  # admitted as the client left: give it back
            elif self._waiting.pop(ticket, None) is not None:
                self.room.remove(ticket)
                self.metrics.set_waiting(self.room)
            raise

    def _may_pass(self, priority: Priority, tenant: str) -> bool:
        """Whether a newcomer may skip the room: nobody of its class or higher waits
        here, and its tenant is not over its cluster-wide share (else a gateway whose
        room is empty would hand a held tenant what the other replicas hold back)."""
        waiting = self.room.waiting_at_or_above(priority)
        return waiting == 0 and not self.view.over_share(priority, tenant)

    def _fits(self, cost: Cost, priority: Priority, waited: float) -> bool:
        if not self.signalled:
            return True  # no signals: fail open
        if self.capacity.never_fits(cost):
            return True  # no pool could hold it: the worker refuses it at once (a 400)
        estimate = self.capacity.estimate(cost, priority)
        if estimate is None:
            return self.capacity.pending < UNMEASURED_PENDING
        delay, idle = estimate.start_delay_s, estimate.idle_delay_s
        # Within its budget (its wait so far and the work ahead of it, `_wait_allowed_s`),
        # and without queueing long in the engine: a backlog left in the waiting room is
        # still in class and fairness order, one in an engine's queue is not (a tenant
        # admitted up to the whole budget would keep the next request of a quieter
        # tenant waiting behind it).
        return (
            waited + (delay - idle) <= self._wait_allowed_s(priority, idle)
            and delay <= idle + QUEUE_TARGET_S
            and self.capacity.decode_fits(cost)
            and self._itl_fits(priority)
        )

    def _itl_fits(self, priority: Priority) -> bool:
        """Whether the decode step a new stream of `priority` would join stays within its
        class's share of `itl_budget_s`. True where nothing is measured (fail open) and
        while a decode worker would have no stream (an idle worker serves, however
        slow). A step slower than the budget with one stream is logged once: each
        worker then takes a stream only when it has none, which is what the budget
        asks, but more likely a budget set below what the model can do.

        Holding streams back helps even then: steps that also prefill (the decode
        worker prefills short prompts itself) take the time of both, and every request
        refused is a prefill those steps do not run. Measured: standing aside whenever
        one stream's step passed the budget let the critical class's ITL p90 reach
        186 ms against a 67 ms SLO (docs/history.md, "ITL admission standing aside")."""
        budget = self.config.itl_budget_s
        if budget <= 0:  # off (the default): no need to predict
            return True
        outlook = self.capacity.decode_step_s_with()
        if outlook is None or outlook.idle:
            return True
        step_s = outlook.step_s * self.capacity.itl_calibration.factor
        if outlook.alone_s > budget and not self._warned_slow:
            self._warned_slow = True
            log.warning("a decode step with one stream took %.0f ms, over itl_budget_s "
                        "(%.0f ms): decode workers take a stream only when they have none; "
                        "raise --itl-budget-s if the model cannot do better",
                        outlook.alone_s * 1000, budget * 1000)  # fmt: skip
        return step_s <= budget * ITL_SHARE[priority]

    def _wait_allowed_s(self, priority: Priority, idle_s: float) -> float:
        """The most a request whose own prefill takes `idle_s` on an idle pool may wait
        (in the room, then behind the work ahead of it): what its TTFT budget leaves
        after its prefill, within `HEADROOM`, but never under `MIN_WAIT_SHARE` of the
        budget. Without that floor a prompt whose prefill alone outlasts the budget
        was refused even by an idle cluster; with a larger one (the whole budget was
        tried) such a prompt waits at the head of its class for seconds, and the room
        admits nobody of the class behind it (measured: docs/history.md, the
        wait-budget run)."""
        budget = self.config.budget_s(priority)
        return max(budget * HEADROOM - idle_s, budget * MIN_WAIT_SHARE)

    def _admitted(self, priority: Priority, cost: Cost, waited: float) -> Pass:
        self.metrics.admitted(priority, waited)
        return self.capacity.admitted(cost, priority)

    def _overloaded(self, ticket: Ticket, reason: RefusalReason, why: str = "") -> Overloaded:
        self.metrics.refused(ticket.priority, reason, ticket.waited(time.monotonic()))
        retry = self._retry_after_s(ticket)
        what = {
            RefusalReason.ROOM_FULL: f"the waiting room is full ({self.room.capacity} places)",
            RefusalReason.DISPLACED: why,
            RefusalReason.BUDGET: why or self._no_capacity(ticket),
        }.get(reason, why)
        return Overloaded(
            f"overloaded: {ticket.priority.label} request refused: {what}; retry in {retry:.0f}s",
            reason,
            retry,
        )

    def _no_capacity(self, ticket: Ticket) -> str:
        """Why a ticket that waited its whole budget never fitted."""
        what = f"no capacity within its {ticket.budget_s:g}s TTFT budget"
        outlook = self.capacity.decode_step_s_with() if self.signalled else None
        if outlook is not None and not self._itl_fits(ticket.priority):
            limit = self.config.itl_budget_s * ITL_SHARE[ticket.priority]
            what += (
                " (the decode step it would join is predicted at "
                f"{outlook.step_s * self.capacity.itl_calibration.factor * 1000:.0f} "
                f"ms, over its class's {limit * 1000:.0f} ms of itl_budget_s)"
            )
        return what

    def _retry_after_s(self, ticket: Ticket) -> float:
        delay = self.capacity.start_delay_s(ticket.cost, ticket.priority)
        return min(MAX_RETRY_S, max(1.0, math.ceil(delay)))

    def _refuse(self, ticket: Ticket, reason: RefusalReason, why: str = "") -> None:
        waiting = self._waiting.pop(ticket, None)
        if waiting is not None and not waiting.done():
            waiting.set_exception(self._overloaded(ticket, reason, why))

    # -- the tick ------------------------------------------------------------------
    async def _run(self) -> None:
        self._signals_at = time.monotonic()
        await self._read_signals()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            self._wake.clear()
            try:
                await self._tick()
            except Exception:  # a tick must never end admission: log and go on
                log.exception("admission tick failed")

    async def _tick(self) -> None:
        now = time.monotonic()
        if now - self._signals_at >= SIGNAL_REFRESH_S:
            self._signals_at = now
            await self._read_signals()
        if self.fair is not None and now - self._fair_at >= FAIR_SYNC_S:
            await self._sync_fairness(now)
        now = time.monotonic()
        for ticket in self.room.expired(now):
            self._refuse(ticket, RefusalReason.BUDGET)
        self._dispatch(now)
        self.metrics.set_waiting(self.room)

    async def _read_signals(self) -> None:
        assert self.board is not None
        try:
            signals: list[WorkerSignal] = await asyncio.to_thread(self.board.read, tuple(Role))
        except REDIS_DOWN_ERRORS as exc:
            if self.signalled:
                log.warning("Redis unreachable (%s): admission fails open until it returns", exc)
            self.signalled = False
            self._first_read.set()
            return
        self.signalled = bool(signals)
        self.capacity.update(signals)
        outlook = self.capacity.decode_step_s_with()
        factor = self.capacity.itl_calibration.factor
        self.metrics.set_decode_step(outlook.step_s * factor if outlook is not None else 0.0)
        self._first_read.set()

    def _dispatch(self, now: float) -> None:
        def fits(t: Ticket) -> bool:
            return self._fits(t.cost, t.priority, t.waited(now))

        def doomed(t: Ticket) -> bool:
            return self._doomed(t, now)

        while (ticket := self.room.pick(now, fits, self.view.over_share, doomed)) is not None:
            waiting = self._waiting.pop(ticket)
            admitted = self._admitted(ticket.priority, ticket.cost, ticket.waited(now))
            if waiting.done():  # cancelled meanwhile
                admitted.settled = True
            else:
                waiting.set_result(admitted)

    def _doomed(self, ticket: Ticket, now: float) -> bool:
        """It has waited longer than it may (`_wait_allowed_s`): even an idle pool could
        not start it now."""
        idle = self.capacity.idle_delay_s(ticket.cost, ticket.priority) if self.signalled else 0.0
        return ticket.waited(now) > self._wait_allowed_s(ticket.priority, idle)

    async def _sync_fairness(self, now: float) -> None:
        assert self.fair is not None
        elapsed, self._fair_at = now - self._fair_at, now
        charges: dict[Priority, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for use in self._usage():
            weight = self._weights.get(use.tenant, 1.0)
            charges[use.priority][use.tenant] += use.blocks * elapsed / weight
        # Only tenants that could still start count as waiting: a tenant whose tickets
        # are all doomed must not hold the others back.
        backlog = {p: self.room.tenants(p, lambda t: not self._doomed(t, now)) for p in Priority}
        self.view = await asyncio.to_thread(self.fair.sync, charges, backlog)
        self.metrics.set_fairness(self.view, self._weights)


@dataclass(frozen=True, slots=True)
class Usage:
    """One live request's KV use, as the ledger charges it."""

    priority: Priority
    tenant: str
    blocks: int

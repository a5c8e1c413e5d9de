"""What the cluster can take right now, from the workers' live signals.

Lifecycle: the admission controller keeps one `Capacity`. Each tick it hands in the
latest `WorkerSignal`s (read from Redis, `services.router.worker_signal`) with `update`;
between ticks it asks `estimate` (how long until a request's prefill could start and
finish, given the work ahead of it, and how much of that is its own prefill) and
`decode_fits` (whether the decode pool has
the KV blocks the request will need), and tells it which requests it let in (`admitted`)
and when their KV reached a decode worker (`settled`), so that the requests it admitted
since the last signal count before the workers report them.

The estimate: a request of class c waits behind the prompt tokens not yet computed on
the prefill pool in classes >= c (the engines admit higher classes first), plus the
prompts this gateway admitted that had not reached a worker when the pool's oldest
signal was taken, plus its own prompt. The pool computes `prefill_tokens_per_s` (summed
over workers, each measured while busy), less what higher classes have been taking
lately (they arrive while it waits, and go first). Workers measure their speed before
they register (`services/worker/calibration.py`); where no worker has one there is no
estimate (admission lets a few requests in at a time until there is).

With conditional disaggregation the decode pool prefills too, and a prompt that the
gateway may prefill there (`SitePolicy.local_limit`: up to `BUSY_FACTOR` times the
local limit) is estimated on each pool it may take and gets the sooner: a chat prompt
is not held back by 4k-token prompts queued on the prefill pool, which it never waits
behind (when the two pools were one estimate, the disaggregated headline refused chat
requests for "no capacity within the TTFT budget" while the decode worker that would
prefill them was idle). A longer prompt waits on the prefill pool alone.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.priority import Priority
from services.common.role import Role
from services.gateway.flow.itl_calibration import ItlCalibration, ItlMeter
from services.gateway.flow.prefill_site import SitePolicy
from services.gateway.flow.step_model import step_s_at
from services.gateway.flow.worker_loads import WorkerLoads

if TYPE_CHECKING:  # only its fields are read here
    from services.router.worker_signal import WorkerSignal

DEFAULT_BLOCK_SIZE = 16
DEFAULT_DECODE_STEP_S = 0.05  # before a decode worker reports its step time
ARRIVAL_WINDOW_S = 5.0  # admitted prompt tokens per second are measured over this
# However much higher classes take, a lower class is never estimated at less than this
# share of the pool's speed (the engines' admission is not strictly starving).
MIN_RATE_SHARE = 0.1
MIN_FACTOR, MAX_FACTOR = 0.5, 5.0  # bounds of one calibration sample


@dataclass(frozen=True)
class Cost:
    """What one request asks of the cluster."""

    prompt_tokens: int
    max_tokens: int

    def blocks(self, block_size: int) -> int:
        """KV blocks it holds at its longest."""
        return math.ceil((self.prompt_tokens + self.max_tokens) / block_size)


@dataclass(frozen=True)
class Estimate:
    """One request's prefill on the soonest pool that may take it, calibrated seconds."""

    start_delay_s: float  # until its prefill could be done: the work ahead, then its own
    idle_delay_s: float  # its own prefill alone, were that pool idle: not queueing


@dataclass(frozen=True)
class DecodeOutlook:
    """The best decode worker for a new stream: its predicted step time with the stream
    (counting the streams admitted but not yet shown) and its step with one stream
    alone; `idle`: some decode worker would have no stream."""

    step_s: float
    alone_s: float
    idle: bool


@dataclass(eq=False)
class Pass:
    """An admitted request, counted against capacity until the workers report it."""

    cost: Cost
    priority: Priority
    admitted: float = field(default_factory=time.monotonic)
    sent: float | None = None  # when its prompt went to a worker (in that worker's queue)
    settled: bool = False  # its KV reached a decode worker (or it ended)
    decode_at: float | None = None  # when a decode worker's signals began to count it
    itl_estimate_s: float = 0.0  # the decode step predicted when it was admitted (0: none)
    estimate_s: float = 0.0  # the raw start delay estimated when it was admitted
    first_token: float | None = None  # when its first token came back

    def unseen_at(self, taken: float) -> bool:
        """Whether a signal taken at `taken` cannot count it yet."""
        return self.sent is None or self.sent >= taken


@dataclass(frozen=True)
class PoolView:
    """One pool's signals at one tick."""

    signals: tuple[WorkerSignal, ...] = ()
    taken: float = 0.0  # time.monotonic() of the oldest signal's publication

    @property
    def rate(self) -> float:
        return sum(s.prefill_tokens_per_s for s in self.signals)

    def tokens_ahead(self, priority: Priority) -> int:
        return sum(s.waiting_tokens[p] for s in self.signals for p in Priority if p >= priority)

    @property
    def free_blocks(self) -> int:
        return sum(s.free_blocks for s in self.signals)

    @property
    def largest_pool(self) -> int:
        """The most blocks one worker has in all: a request needing more fits nowhere."""
        return max((s.total_blocks for s in self.signals), default=0)

    @property
    def block_size(self) -> int:
        return next((s.block_size for s in self.signals if s.block_size), DEFAULT_BLOCK_SIZE)

    @property
    def decode_step_s(self) -> float:
        steps = [s.decode_step_s for s in self.signals if s.decode_step_s > 0]
        return sum(steps) / len(steps) if steps else DEFAULT_DECODE_STEP_S


class Calibration:
    """How far the estimates run behind what happens: the mean of (admission to first
    token) / (estimated delay) over recent requests. The estimate counts tokens at the
    pool's step speed; what it leaves out (requests prefilled side by side, routing, the
    KV export, a busy host) this factor puts back. Starts at 1."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.factor = 1.0

    def observe(self, admission: Pass) -> None:
        assert admission.first_token is not None
        seen = admission.first_token - admission.admitted
        ratio = min(MAX_FACTOR, max(MIN_FACTOR, seen / max(admission.estimate_s, 0.01)))
        self.factor += self.alpha * (ratio - self.factor)


class Arrivals:
    """Prompt tokens admitted here per second, by class, over the last few seconds."""

    def __init__(self, window_s: float = ARRIVAL_WINDOW_S) -> None:
        self.window_s = window_s
        self._recent: deque[Pass] = deque()

    def add(self, admission: Pass) -> None:
        self._recent.append(admission)
        horizon = admission.admitted - self.window_s
        while self._recent and self._recent[0].admitted < horizon:
            self._recent.popleft()

    def rate_above(self, priority: Priority) -> float:
        horizon = time.monotonic() - self.window_s
        tokens = sum(
            p.cost.prompt_tokens
            for p in self._recent
            if p.priority > priority and p.admitted >= horizon
        )
        return tokens / self.window_s


def _view(signals: Sequence[WorkerSignal], now: float) -> PoolView:
    if not signals:
        return PoolView()
    return PoolView(tuple(signals), now - max(s.age_s for s in signals))


class Capacity:
    """`sites`: the gateway's conditional-disaggregation thresholds (none, or a local
    limit of 0: every prompt takes the prefill hop). Above 0, decode workers prefill the
    prompts the gateway keeps local, so a prompt it may keep local is also estimated on
    the decode pool (`local`), and gets the sooner of the two estimates. `self.sites` is
    that policy reading live loads from here (`loads`): the one the gateway
    routes by too, so admission and routing judge a prompt by the same rule."""

    def __init__(self, sites: SitePolicy | None = None) -> None:
        self.loads = WorkerLoads()
        self.sites = replace(sites or SitePolicy(0, 0.0), loads=self.loads)
        self.prefill = PoolView()
        self.local = PoolView()  # the decode pool as a prefill site; empty when none
        self.decode = PoolView()
        self._passes: list[Pass] = []
        self._arrivals = Arrivals()
        self.calibration = Calibration()
        self.itl_calibration = ItlCalibration()

    def update(self, signals: Sequence[WorkerSignal], now: float | None = None) -> None:
        """Take a tick's signals. Prefill work goes to prefill workers (mixed ones when
        the cluster has no prefill pool), and to decode workers for the prompts the
        gateway keeps local; the KV lives on decode (or mixed) workers. A lone decode pool
        (its prefill worker changed role at run time) prefills too: both views."""
        now = time.monotonic() if now is None else now
        prefill = [s for s in signals if s.role is Role.PREFILL]
        decode = [s for s in signals if s.role is Role.DECODE]
        mixed = [s for s in signals if s.role is Role.MIXED]
        self.prefill = _view(prefill or mixed or decode, now)
        self.local = _view(decode if prefill and self.sites.local_limit() > 0 else [], now)
        self.decode = _view(decode or mixed, now)
        self.loads.update(signals, now)
        for p in self._passes:
            if p.first_token is not None and p.estimate_s > 0:
                self.calibration.observe(p)
                p.estimate_s = 0.0  # observed once
        # A settled pass stays until a decode signal taken after its stream began there
        # shows it: until then only `decode_step_s_with` counts it.
        self._passes = [p for p in self._passes if not p.settled or self._decode_unseen(p)]

    def queue_s(self, worker_id: str) -> float:
        """Seconds of prefill waiting on one worker at its last signal (its queued prompt
        tokens over its measured speed); 0 without a signal or a measured speed."""
        return self.loads.queue_s(worker_id)

    def estimate(self, cost: Cost, priority: Priority) -> Estimate | None:
        """The request's estimate on the soonest pool that may prefill it, calibrated;
        None where no such pool has measured its speed. One pass over the sites: what
        admission asks of each request on every tick."""
        soonest = self._soonest(cost, priority)
        if soonest is None:
            return None
        raw, pool = soonest
        factor = self.calibration.factor
        return Estimate(raw * factor, cost.prompt_tokens / pool.rate * factor)

    def start_delay_s(self, cost: Cost, priority: Priority) -> float:
        """`Estimate.start_delay_s`; 0 when there is no estimate (see `estimate`)."""
        found = self.estimate(cost, priority)
        return 0.0 if found is None else found.start_delay_s

    def raw_delay_s(self, cost: Cost, priority: Priority) -> float:
        """The uncalibrated estimate on the soonest pool that may prefill it."""
        soonest = self._soonest(cost, priority)
        return 0.0 if soonest is None else soonest[0]

    def idle_delay_s(self, cost: Cost, priority: Priority = Priority.STANDARD) -> float:
        """`Estimate.idle_delay_s`; 0 when there is no estimate."""
        found = self.estimate(cost, priority)
        return 0.0 if found is None else found.idle_delay_s

    def _soonest(self, cost: Cost, priority: Priority) -> tuple[float, PoolView] | None:
        """(the uncalibrated delay, the pool) of the soonest site, None without one."""
        delays = [(self._delay_on(pool, cost, priority), pool) for pool in self._sites(cost)]
        return min(delays, key=lambda delay: delay[0], default=None)

    def _sites(self, cost: Cost) -> list[PoolView]:
        """The pools with a measured speed that may prefill the request, as
        `prefill_site.SitePolicy` places it: a prompt within the local limit on the
        decode pool, or on the prefill pool where the busy rule may send it there; one
        of up to `BUSY_FACTOR` times the limit on the prefill pool, or on the decode
        pool while the prefill pool's queue is past `busy_s`; a longer one on the
        prefill pool."""
        if self._may_stay_local(cost):
            short = cost.prompt_tokens <= self.sites.local_max_tokens
            if short:
                pools = [self.local, self.prefill] if self.sites.busy_s > 0 else [self.local]
            else:
                pools = [self.prefill, self.local] if self._prefill_busy() else [self.prefill]
        else:
            pools = [self.prefill]
        return [pool for pool in pools if pool.rate > 0]

    def _may_stay_local(self, cost: Cost) -> bool:
        """Whether the gateway may prefill it on its decode worker at all."""
        return bool(self.local.signals) and 0 < cost.prompt_tokens <= self.sites.local_limit()

    def _prefill_busy(self) -> bool:
        """Whether every prefill worker's queue is past `busy_s` (the one a prompt is
        routed to would be)."""
        busy_s = self.sites.busy_s
        queues = [self.queue_s(s.worker_id) for s in self.prefill.signals]
        return busy_s > 0 and bool(queues) and min(queues) > busy_s

    def _delay_on(self, pool: PoolView, cost: Cost, priority: Priority) -> float:
        """Tokens ahead on `pool` over the speed left to the request's class. Admitted
        prompts its signals cannot show yet count on each pool that may have taken
        them (which one did is not known here)."""
        local = pool is self.local
        unseen = sum(
            p.cost.prompt_tokens
            for p in self._unsettled()
            if p.priority >= priority
            and p.unseen_at(pool.taken)
            and (not local or self._may_stay_local(p.cost))
        )
        # Higher classes that arrive while it waits go first (the engines admit them
        # first): only the speed they leave over is its own.
        rate = pool.rate
        left = max(rate * MIN_RATE_SHARE, rate - self._arrivals.rate_above(priority))
        return (pool.tokens_ahead(priority) + unseen + cost.prompt_tokens) / left

    def decode_fits(self, cost: Cost) -> bool:
        """Whether the decode pool has room for the request beside the ones admitted
        here whose KV has not reached it yet. True when no decode worker reports."""
        if not self.decode.signals or self.never_fits(cost):
            return True
        size = self.decode.block_size
        pending = sum(p.cost.blocks(size) for p in self._unsettled())
        return self.decode.free_blocks - pending >= cost.blocks(size)

    def decode_step_s_with(self) -> DecodeOutlook | None:
        """The decode step a new stream would see (its inter-token latency) on the decode
        worker where it is shortest. Each worker runs the streams its signal shows
        (running and waiting); the streams admitted here that no decode signal shows yet
        (`_decode_unseen`) are spread over the workers, each to the least loaded, as the
        router's load bound would. None where no decode worker has published its step
        times (`decode_curve`)."""
        workers = list(self.decode.signals)
        if not any(s.decode_curve for s in workers):
            return None
        streams = [s.running + s.waiting for s in workers]
        for _ in range(sum(1 for p in self._passes if self._decode_unseen(p))):
            least = min(range(len(streams)), key=streams.__getitem__)
            streams[least] += 1
        best: DecodeOutlook | None = None
        for s, n in zip(workers, streams, strict=True):
            step, alone = step_s_at(s.decode_curve, n + 1), step_s_at(s.decode_curve, 1)
            if step is None or alone is None:
                continue
            if best is None or step < best.step_s:
                best = DecodeOutlook(step, alone, min(streams) == 0)
        return best

    def _decode_unseen(self, p: Pass) -> bool:
        """Whether a pass's stream will be, or is, in a decode batch that the decode
        pool's signals do not show: admitted and not yet on a decode worker (prefilling
        elsewhere, or waiting), or on one since after the oldest signal was taken. A
        pass that ended before it decoded counts nowhere."""
        if p.decode_at is None:
            return not p.settled
        return p.decode_at >= self.decode.taken

    def never_fits(self, cost: Cost) -> bool:
        """Whether no worker of either pool could ever hold the request (its prompt plus
        max_tokens). Waiting would only run out its budget, so admission lets it through
        and the worker refuses it at once, naming max_tokens and its pool (a 400)."""
        # The decode pool prefills too with conditional disaggregation: the prefill
        # side holds a request if either pool does.
        prefill_room = max(self.prefill.largest_pool, self.local.largest_pool)
        rooms = ((self.prefill, prefill_room), (self.decode, self.decode.largest_pool))
        return any(
            bool(pool.signals) and cost.blocks(pool.block_size) > room for pool, room in rooms
        )

    def kv_block_seconds(self, cost: Cost) -> float:
        """The request's estimated KV-block-seconds: its blocks held for its decode."""
        blocks = cost.blocks(self.decode.block_size)
        return blocks * max(1, cost.max_tokens) * self.decode.decode_step_s

    def admitted(self, cost: Cost, priority: Priority) -> Pass:
        outlook = self.decode_step_s_with()
        admission = Pass(cost, priority, estimate_s=self.raw_delay_s(cost, priority),
                         itl_estimate_s=outlook.step_s if outlook is not None else 0.0)  # fmt: skip
        self._passes.append(admission)
        self._arrivals.add(admission)
        return admission

    def itl_meter(self, admission: Pass | None) -> ItlMeter | None:
        """A meter of the admitted stream's gaps that calibrates the ITL prediction, or
        None when nothing was predicted for it."""
        if admission is None or admission.itl_estimate_s <= 0:
            return None
        return ItlMeter(self.itl_calibration, admission.itl_estimate_s)

    @property
    def pending(self) -> int:
        """Admitted requests whose KV has not reached a decode worker."""
        return sum(1 for _ in self._unsettled())

    def _unsettled(self) -> Iterator[Pass]:
        """The passes still counted here: admitted, KV not yet on a decode worker."""
        return (p for p in self._passes if not p.settled)

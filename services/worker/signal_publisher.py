"""A worker's live load signal: measured from its engine, published to Redis.

Lifecycle: `SignalPublisher(board, engine.stats, worker_id, role, interval_s).start()`
starts a task that, every `interval_s`, takes the engine's stats, updates the smoothed
speeds and publishes a `WorkerSignal` (one Redis round trip, off the event loop). A
Redis outage is logged once and the task goes on: the first publish after Redis is back
restores the signal. `stop()`, which the worker calls as it starts to drain (it takes no
new work from then on, so it must not advertise room), ends the task and withdraws the
signal; if Redis is down then, the signal expires after the board's TTL
(`signal_ttl_s`). Given a `ResidencyFeed` (`report_cache`), each publish also reports
the engine's prefix cache changes right after the signal, and `stop()` withdraws that
report too.

Speeds: the engine's counters only grow (`EngineStats.*_total`), so each interval's
differences give one sample of prefill tokens per busy second and of seconds per decode
step. Only intervals with such work give a sample, and each is weighted by the busy time
behind it (`BusyAverage`), so the speeds are the engine's while it works: neither idle
time nor an interval with one tiny chunk moves them much. On a mixed worker a step may
prefill and decode at once; it counts for both, which is the speed each kind of work
actually gets there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

import redis

from engine.stats import EngineStats
from services.common.role import Role
from services.router.redis_client import REDIS_DOWN_ERRORS
from services.router.worker_signal import SignalBoard, WorkerSignal
from services.worker.residency_feed import ResidencyFeed

log = logging.getLogger(__name__)

#: Busy seconds over which a speed forgets its past (its time constant).
SPEED_HORIZON_S = 1.0
#: Seconds after which a decode-curve point with no new sample is no longer published.
CURVE_AGE_S = 60.0
#: What a failed publish or withdraw raises: Redis down or refusing, not a bug here.
_PUBLISH_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, *REDIS_DOWN_ERRORS)


def signal_ttl_s(interval_s: float) -> float:
    """How long a published signal lives: several missed publishes (a pause, one slow
    Redis reply) do not drop it, and a dead worker's is gone within a couple of seconds."""
    return max(2.0, 8 * interval_s)


class BusyAverage:
    """A mean of samples weighted by the busy seconds each covers, forgetting the past
    with a time constant of `horizon_s` busy seconds. 0.0 until the first sample."""

    def __init__(self, horizon_s: float = SPEED_HORIZON_S) -> None:
        self.horizon_s = horizon_s
        self.value = 0.0
        self.measured = False

    def add(self, sample: float, busy_s: float) -> None:
        if busy_s <= 0:
            return
        if not self.measured:
            self.value, self.measured = sample, True
            return
        self.value += (1.0 - math.exp(-busy_s / self.horizon_s)) * (sample - self.value)


class DecodeCurve:
    """Seconds per decode step by batch size: what the gateway's admission predicts a
    stream's inter-token latency from (`services.gateway.flow.step_model`).

    Each interval that decoded gives one sample: its mean batch (the rows a step
    decoded: tokens sampled less the drafts speculation accepted, over steps) and its
    mean step time. Samples go to the bucket of their batch (powers of two: 1, 2, 3-4,
    5-8, ...), where a `BusyAverage` keeps both the batch and the step time, so a point
    is where that bucket's steps actually ran. The curve is the measured buckets'
    points; a bucket with no sample for `max_age_s` is left out, so one slow interval
    (a warm-up, a noisy neighbour) cannot hold admission below its batch for good.
    """

    def __init__(self, horizon_s: float = SPEED_HORIZON_S, max_age_s: float = CURVE_AGE_S) -> None:
        self.horizon_s = horizon_s
        self.max_age_s = max_age_s
        self._buckets: dict[int, tuple[BusyAverage, BusyAverage, float]] = {}

    def add(self, batch: float, step_s: float, busy_s: float, now: float) -> None:
        """One interval's sample, taken at `now` (monotonic seconds)."""
        if batch <= 0 or step_s <= 0:
            return
        bucket = max(0, math.ceil(math.log2(batch)))
        sizes, times, _ = self._buckets.get(
            bucket, (BusyAverage(self.horizon_s), BusyAverage(self.horizon_s), now)
        )
        sizes.add(batch, busy_s)
        times.add(step_s, busy_s)
        self._buckets[bucket] = (sizes, times, now)

    def points(self, now: float) -> tuple[tuple[float, float], ...]:
        """(mean batch, seconds per step) of each bucket measured within `max_age_s` of
        `now`, smallest first."""
        return tuple(
            (b.value, t.value)
            for _, (b, t, at) in sorted(self._buckets.items())
            if now - at <= self.max_age_s
        )


class EngineSpeeds:
    """Prefill tokens per second and seconds per decode step (overall, and by batch
    size: `curve`), from successive stats."""

    def __init__(
        self, horizon_s: float = SPEED_HORIZON_S, since: EngineStats | None = None
    ) -> None:
        """`since`: count from these stats (the worker's calibration baseline: the work
        before it, a cold warm-up, is not a speed); None counts from the engine's start."""
        self.prefill_tokens_per_s = BusyAverage(horizon_s)
        self.decode_step_s = BusyAverage(horizon_s)
        self.curve = DecodeCurve(horizon_s)
        # The counters at the last update; they start at `since` (else 0, with the engine),
        # so the work done after it and before the first update counts too.
        self._prefill = (0, 0.0)  # (tokens, busy seconds)
        self._decode = (0, 0.0, 0)  # (steps, busy seconds, rows decoded)
        if since is not None:
            self._prefill = (since.prefill_tokens_total, since.prefill_busy_s_total)
            self._decode = _decode_counts(since)

    def update(self, s: EngineStats, now: float | None = None) -> None:
        """Fold in the stats taken at `now` (monotonic; default: now)."""
        now = time.monotonic() if now is None else now
        prefill = (s.prefill_tokens_total, s.prefill_busy_s_total)
        decode = _decode_counts(s)
        tokens, prefill_s = prefill[0] - self._prefill[0], prefill[1] - self._prefill[1]
        steps, decode_s = decode[0] - self._decode[0], decode[1] - self._decode[1]
        rows = decode[2] - self._decode[2]
        self._prefill, self._decode = prefill, decode
        if tokens > 0 and prefill_s > 0:
            self.prefill_tokens_per_s.add(tokens / prefill_s, prefill_s)
        if steps > 0 and decode_s > 0:
            self.decode_step_s.add(decode_s / steps, decode_s)
            self.curve.add(rows / steps, decode_s / steps, decode_s, now)


def _decode_counts(s: EngineStats) -> tuple[int, float, int]:
    """(decode steps, their busy seconds, rows they decoded): a row samples one token
    plus the drafts speculation accepted for it."""
    rows = s.decode_tokens_total - s.spec_accepted_total
    return (s.decode_steps_total, s.decode_busy_s_total, rows)


class SignalPublisher:
    """Publishes one worker's `WorkerSignal` every `interval_s` until stopped."""

    def __init__(
        self,
        board: SignalBoard,
        stats: Callable[[], EngineStats],
        worker_id: str,
        role: Role,
        interval_s: float = 0.25,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.board = board
        self.stats = stats  # LLMEngine.stats: never waits behind a step
        self.worker_id = worker_id
        self.role = Role.parse(role)
        self.interval_s = interval_s
        self.feed: ResidencyFeed | None = None
        self.speeds = EngineSpeeds()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._down = False  # the last publish failed (logged once per outage)

    def count_from(self, since: EngineStats) -> SignalPublisher:
        """Measure the speeds from `since` on (the worker's calibration baseline: the
        cold warm-up before it is not a speed). Call before `start`."""
        self.speeds = EngineSpeeds(since=since)
        return self

    def report_cache(self, feed: ResidencyFeed) -> SignalPublisher:
        """Also report the engine's prefix cache with each signal (and withdraw it with
        the signal). Call before `start`."""
        self.feed = feed
        return self

    def start(self) -> SignalPublisher:
        self._task = asyncio.create_task(self._run(), name=f"signal-{self.worker_id}")
        self._task.add_done_callback(_log_crash)
        return self

    async def stop(self) -> None:
        """End the task (if started), then withdraw the signal."""
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(Exception):  # a crash was logged when it happened
                await self._task
            self._task = None
        try:
            await asyncio.to_thread(self._withdraw)
        except _PUBLISH_ERRORS as exc:
            log.warning("could not withdraw the load signal of %s (it will expire): %s",
                        self.worker_id, exc)  # fmt: skip

    def _withdraw(self) -> None:
        self.board.withdraw(self.worker_id)
        if self.feed is not None:
            self.feed.withdraw()

    def signal(self, stats: EngineStats) -> WorkerSignal:
        """The signal for `stats`, after folding them into the speeds."""
        self.speeds.update(stats)
        return WorkerSignal(
            worker_id=self.worker_id,
            role=self.role,
            waiting_tokens=stats.waiting_tokens_by_class,
            waiting=stats.waiting,
            running=stats.running,
            free_blocks=stats.free_blocks,
            total_blocks=stats.total_blocks,
            block_size=stats.block_size,
            prefill_tokens_per_s=self.speeds.prefill_tokens_per_s.value,
            decode_step_s=self.speeds.decode_step_s.value,
            decode_curve=self.speeds.curve.points(time.monotonic()),
        )

    async def publish_once(self) -> bool:
        """Take the stats and publish; False (logged once per outage) if Redis failed."""
        try:
            await asyncio.to_thread(self._publish)
        except _PUBLISH_ERRORS as exc:
            if not self._down:
                log.warning("load signal of %s not published, Redis failed: %s; retrying "
                            "every %.2f s", self.worker_id, exc, self.interval_s)  # fmt: skip
            self._down = True
            return False
        if self._down:
            log.info("load signal of %s published again", self.worker_id)
            self._down = False
        return True

    def _publish(self) -> None:
        self.board.publish(self.signal(self.stats()))
        if self.feed is not None:
            self.feed.publish()

    async def _run(self) -> None:
        while not self._stop.is_set():
            await self.publish_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=self.interval_s)


def _log_crash(task: asyncio.Task[None]) -> None:
    """A bug (not Redis) ended the task: say so now, not when the worker stops; the
    signal then expires and the gateway admits as if this worker sent none."""
    if not task.cancelled() and task.exception() is not None:
        log.error("load signal publisher crashed", exc_info=task.exception())

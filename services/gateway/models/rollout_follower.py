"""One gateway's view of a served model's rollout: which version each request goes to,
the outcomes it reports, and the automatic rollback.

Lifecycle: `build_service` makes one follower per named model and `tick()`s it once
before serving, so a restarted gateway follows a rollout already running (or the
version an earlier one promoted) from its first request. `start(refresh_s)` then ticks
every `rollout_refresh_s` in a worker thread until `close()`. A tick:
1. sends the outcomes requests reported since the last tick (`observe`) to Redis;
2. reads the rollout, and has a backend made (`ensure`) for its stable and canary
   versions before any request is sent there;
3. while it runs, compares the canary with the stable version over the window
   (`RollbackPolicy.verdict`) and rolls it back when the canary is worse. The rollback
   is a compare-and-set in Redis, so of several gateways one wins; the others follow it
   at their next tick.
`pick(tenant)` needs no I/O: while a rollout runs, `weight` of the requests go to the
canary (by a random draw, or by a hash of the tenant when it is sticky); otherwise all
go to the stable version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from pdserve.v1 import gateway_pb2
from services.common.status import RolloutConflict
from services.gateway.config import GatewayConfig
from services.router.rollout_store import Outcome, Rollout, RolloutStore, now_ms

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RollbackPolicy:
    window_s: float = 60.0
    min_requests: int = 20  # canary requests in the window before any verdict
    error_margin: float = 0.05  # the canary's error rate may pass the stable one's by this
    latency_margin: float = 0.5  # its TTFT or ITL p90 may pass the stable one's by this share

    @classmethod
    def from_config(cls, config: GatewayConfig) -> RollbackPolicy:
        """The policy of `--rollout-window-s`, `--rollout-min-requests` and the margins."""
        return cls(
            config.rollout_window_s, config.rollout_min_requests, config.rollout_error_margin,
            config.rollout_latency_margin,
        )  # fmt: skip

    def verdict(self, stable: Sequence[Outcome], canary: Sequence[Outcome]) -> str | None:
        """Why the canary should be rolled back, or None while it holds up (or there are
        too few of its requests to tell)."""
        if len(canary) < self.min_requests:
            return None
        err_c, err_s = error_rate(canary), error_rate(stable)
        if err_c > err_s + self.error_margin:
            return (
                f"error rate {err_c:.1%} over {len(canary)} requests against the stable "
                f"version's {err_s:.1%} (margin {self.error_margin:.1%})"
            )
        if len(stable) < self.min_requests:
            return None  # nothing to compare latency with yet
        for name, pick in (("TTFT", ttfts), ("ITL", itls)):
            p_c, p_s = p90(pick(canary)), p90(pick(stable))
            if p_s > 0 and p_c > p_s * (1 + self.latency_margin):
                return (
                    f"{name} p90 {p_c:.3f}s against the stable version's {p_s:.3f}s "
                    f"(margin {self.latency_margin:.0%})"
                )
        return None


class OutcomeClock:
    """Times one request for its `Outcome`: time to its first token after admission (so
    a wait in the waiting room does not count against the version), and the mean gap
    between tokens after that. `outcome` stays None for a request that ended before it
    was admitted or that its client gave up on: neither says anything of the version."""

    def __init__(self) -> None:
        self.start = 0.0
        self.first = self.last = 0.0
        self.tokens = 0
        self.outcome: Outcome | None = None

    def admitted(self) -> None:
        self.start = time.monotonic()

    def message(self, msg: gateway_pb2.GenerateResponse) -> None:
        if msg.token_ids:
            now = time.monotonic()
            self.first = self.first or now
            self.last = now
            self.tokens += len(msg.token_ids)

    def ended(self, *, ok: bool) -> None:
        if not self.start:
            return  # refused before admission: not the version's doing
        ttft = self.first - self.start if self.first else 0.0
        itl = (self.last - self.first) / (self.tokens - 1) if self.tokens > 1 else 0.0
        self.outcome = Outcome(now_ms(), ok, ttft, itl)


def error_rate(outcomes: Sequence[Outcome]) -> float:
    return sum(1 for o in outcomes if not o.ok) / len(outcomes) if outcomes else 0.0


def ttfts(outcomes: Sequence[Outcome]) -> list[float]:
    return [o.ttft_s for o in outcomes if o.ok and o.ttft_s > 0]


def itls(outcomes: Sequence[Outcome]) -> list[float]:
    return [o.itl_s for o in outcomes if o.ok and o.itl_s > 0]


def p90(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


class RolloutFollower:
    def __init__(
        self,
        store: RolloutStore,
        model: str,
        policy: RollbackPolicy,
        ensure: Callable[[str], object],
        on_rollback: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.store = store
        self.model = model
        self.policy = policy
        self.ensure = ensure  # makes the backend of a version (in the tick's thread)
        self.on_rollback = on_rollback
        self.rollout = Rollout(model)
        # Outcomes come from the event loop, ticks from worker threads (the loop's, and
        # an admin call's): one lock for the outcomes, one so that ticks take turns.
        self._lock = threading.Lock()
        self._ticking = threading.Lock()
        self._pending: dict[str, list[Outcome]] = {}
        self._rng = random.Random()
        self._task: asyncio.Task[None] | None = None

    # -- the request path (event loop, no I/O) ----------------------------------------
    def pick(self, tenant: str) -> str:
        """The version this request goes to."""
        r = self.rollout
        if not r.running:
            return r.stable
        if r.sticky:
            draw = xxhash.xxh3_64_intdigest(f"{self.model}\0{tenant}".encode()) / 2**64
        else:
            draw = self._rng.random()
        return r.canary if draw < r.weight else r.stable

    def observe(self, version: str, outcome: Outcome) -> None:
        """A request to `version` ended: counted toward the rollback window."""
        if self.rollout.running:
            with self._lock:
                self._pending.setdefault(version, []).append(outcome)

    # -- the tick (a worker thread) ---------------------------------------------------
    def tick(self) -> Rollout:
        with self._ticking:
            return self._tick()

    def _tick(self) -> Rollout:
        with self._lock:
            pending, self._pending = self._pending, {}
        for version, outcomes in pending.items():
            self.store.record(self.model, version, outcomes)
        rollout = self.store.read(self.model)
        for version in {rollout.stable, rollout.canary} if rollout.running else {rollout.stable}:
            self.ensure(version)
        if rollout.running:
            rollout = self._judge(rollout)
        if rollout != self.rollout:
            log.info(
                "model %s: rollout %s (stable %r, canary %r at %.0f%%)", self.model,
                rollout.phase.value, rollout.stable, rollout.canary, 100 * rollout.weight,
            )  # fmt: skip
        self.rollout = rollout
        return rollout

    def windows(self, rollout: Rollout) -> tuple[list[Outcome], list[Outcome]]:
        """The stable and canary versions' outcomes over the window."""
        since = now_ms() - int(self.policy.window_s * 1000)
        since = max(since, rollout.started_ms)  # outcomes of an earlier rollout do not count
        stable = self.store.window(self.model, rollout.stable, since)
        return stable, self.store.window(self.model, rollout.canary, since)

    def _judge(self, rollout: Rollout) -> Rollout:
        reason = self.policy.verdict(*self.windows(rollout))
        if reason is None:
            return rollout
        try:
            rolled = self.store.roll_back(self.model, f"automatic: {reason}")
        except RolloutConflict:  # another gateway, or an admin, ended it first
            return self.store.read(self.model)
        log.warning("model %s: canary %r rolled back: %s", self.model, rollout.canary, reason)
        self.on_rollback(reason)
        return rolled

    # -- the loop --------------------------------------------------------------------
    def start(self, refresh_s: float) -> None:
        """Tick every `refresh_s` (`--rollout-refresh-s`) until `close()`."""
        self._task = asyncio.get_running_loop().create_task(self._run(refresh_s))

    async def _run(self, refresh_s: float) -> None:
        while True:
            try:
                await asyncio.to_thread(self.tick)
            except Exception as exc:  # Redis away: keep the last view, try again
                log.warning("model %s: rollout state unreadable: %s", self.model, exc)
            await asyncio.sleep(refresh_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.tick)  # the last outcomes

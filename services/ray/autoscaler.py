"""SLO-driven autoscaling of a Ray cluster's worker pools.

The prefill pool is sized on time to first token and the prompt tokens its engines still
owe; the decode pool on inter-token latency and KV-cache utilisation, each against a
target (`AutoscaleConfig`, the SLO flags). A pool grows by one worker when any of its
signals is over target, and shrinks by one only when all of them have stayed under
`down_fraction` of their targets for `down_window_s` (hysteresis: the band between the
two never moves it); after any change it waits out a cool-down (`up_cooldown_s`,
`down_cooldown_s`) so the new size is measured before the next step. Sizes stay within
[min, max]. A removed worker drains first (`ClusterController.scale`), so scaling down
drops no stream; a new one ramps its share of placements (the router's slow start).

Lifecycle: `ClusterController.autoscale(cfg)` starts an `AutoscaleLoop` thread; every
`interval_s` it reads the signals (`SignalReader.read`: the workers' load signals in
Redis, and the gateway's TTFT and ITL histograms from its /metrics, differenced since the
previous read), asks `Autoscaler.decide` for each pool's target, and calls the
controller's `scale` for any change. `stop()` ends it and closes the reader's Redis
client; `status()` says what it last
decided and why. The decision (`Autoscaler`) is pure and clocked by the caller, so its
tests need no cluster. The same signals drive the chart's KEDA triggers (deploy.md).
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from services.common.metrics import scrape
from services.common.role import Role
from services.router.worker_signal import SignalBoard, WorkerSignal

log = logging.getLogger(__name__)

TTFT = "pdserve_time_to_first_token_seconds"
ITL = "pdserve_inter_token_latency_seconds"


class PoolName(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Why(enum.Enum):
    LATENCY = "latency"  # its latency p90 is over the SLO
    QUEUE = "queue"  # queued prompt tokens per worker over target (prefill)
    KV = "kv"  # KV utilisation over target (decode)
    IDLE = "idle"  # every signal under down_fraction of target for down_window_s
    HOLD = "hold"  # between the two: no change
    COOLDOWN = "cooldown"  # a change is due, but the last one is too recent
    AT_LIMIT = "at_limit"  # a change is due, but the pool is at its min or max


@dataclass(frozen=True)
class AutoscaleConfig:
    interval_s: float = 5.0
    ttft_p90_s: float = 2.0  # prefill pool: the TTFT SLO
    queued_tokens_per_worker: int = 4096  # prefill pool: about a few seconds of prefill
    itl_p90_s: float = 0.25  # decode pool: the ITL SLO
    kv_utilization: float = 0.85  # decode pool
    down_fraction: float = 0.5  # shrink only when every signal is under this x target
    down_window_s: float = 60.0  # ... for this long
    up_cooldown_s: float = 30.0
    down_cooldown_s: float = 120.0
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4

    def __post_init__(self) -> None:
        positive = ("interval_s", "ttft_p90_s", "queued_tokens_per_worker", "itl_p90_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"autoscale {name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.kv_utilization <= 1 or not 0 < self.down_fraction < 1:
            raise ValueError("kv_utilization must be in (0, 1] and down_fraction in (0, 1)")
        for pool in ("prefill", "decode"):
            low, high = getattr(self, f"min_{pool}"), getattr(self, f"max_{pool}")
            if not 1 <= low <= high:
                raise ValueError(f"autoscale needs 1 <= min_{pool} <= max_{pool}")

    def limits(self, pool: PoolName) -> tuple[int, int]:
        if pool is PoolName.PREFILL:
            return self.min_prefill, self.max_prefill
        return self.min_decode, self.max_decode


@dataclass(frozen=True)
class PoolSignals:
    """One pool's state at one read. `latency_p90_s` is TTFT (prefill) or ITL (decode)
    over the last interval; None when no request finished a token in it."""

    workers: int
    latency_p90_s: float | None = None
    queued_prompt_tokens: int = 0
    kv_utilization: float = 0.0


@dataclass(frozen=True)
class Decision:
    pool: PoolName
    current: int
    target: int
    why: Why


@dataclass
class _PoolState:
    changed_at: float = -math.inf
    low_since: float | None = None


class Autoscaler:
    """The decisions (pure: the caller passes the clock)."""

    def __init__(self, cfg: AutoscaleConfig) -> None:
        self.cfg = cfg
        self._state = {pool: _PoolState() for pool in PoolName}

    def decide(self, pool: PoolName, s: PoolSignals, now: float) -> Decision:
        over, under = self._pressure(pool, s)
        state = self._state[pool]
        if not under:
            state.low_since = None
        elif state.low_since is None:
            state.low_since = now
        low, high = self.cfg.limits(pool)
        if over is not None:
            return self._step(pool, s.workers, +1, over, now, high, self.cfg.up_cooldown_s)
        if state.low_since is not None and now - state.low_since >= self.cfg.down_window_s:
            return self._step(pool, s.workers, -1, Why.IDLE, now, low, self.cfg.down_cooldown_s)
        return Decision(pool, s.workers, s.workers, Why.HOLD)

    def _step(
        self, pool: PoolName, n: int, delta: int, why: Why, now: float, limit: int, cool: float
    ) -> Decision:
        state = self._state[pool]
        if (delta > 0 and n >= limit) or (delta < 0 and n <= limit):
            return Decision(pool, n, n, Why.AT_LIMIT)
        if now - state.changed_at < cool:
            return Decision(pool, n, n, Why.COOLDOWN)
        state.changed_at = now
        state.low_since = None  # the new size is judged afresh
        return Decision(pool, n, n + delta, why)

    def _pressure(self, pool: PoolName, s: PoolSignals) -> tuple[Why | None, bool]:
        """(the first signal over its target, or None; whether all are under the low mark)."""
        cfg, workers = self.cfg, max(1, s.workers)
        if pool is PoolName.PREFILL:
            signals = [
                (Why.LATENCY, s.latency_p90_s or 0.0, cfg.ttft_p90_s),
                (Why.QUEUE, s.queued_prompt_tokens / workers, cfg.queued_tokens_per_worker),
            ]
        else:
            signals = [
                (Why.LATENCY, s.latency_p90_s or 0.0, cfg.itl_p90_s),
                (Why.KV, s.kv_utilization, cfg.kv_utilization),
            ]
        over = next((why for why, value, target in signals if value > target), None)
        under = all(value < cfg.down_fraction * target for _, value, target in signals)
        return over, under


def bucket_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile of a histogram given as (upper bound, cumulative count), sorted,
    interpolated linearly inside the bucket it falls in (as PromQL's
    histogram_quantile); None when the histogram is empty. A quantile in the +Inf bucket
    is the highest finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            width = count - lower_count
            share = (rank - lower_count) / width if width > 0 else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def histogram(page: Mapping[str, float], name: str) -> dict[float, float]:
    """A scraped histogram's cumulative bucket counts by upper bound (labels summed)."""
    out: dict[float, float] = {}
    prefix = f"{name}_bucket{{"
    for key, value in page.items():
        if key.startswith(prefix):
            labels = dict(
                part.split("=", 1) for part in key[len(prefix) : -1].split(",") if "=" in part
            )
            bound = float(labels["le"])
            out[bound] = out.get(bound, 0.0) + value
    return out


@dataclass
class SignalReader:
    """Reads what `Autoscaler` decides on: Redis load signals, gateway histograms."""

    board: SignalBoard
    gateway_metrics: Callable[[], Mapping[str, float]]  # one scrape of the gateway's /metrics
    _last: dict[str, dict[float, float]] = field(default_factory=dict)

    @classmethod
    def for_gateway(cls, board: SignalBoard, host: str, port: int) -> SignalReader:
        return cls(board, lambda: scrape(port, host))

    def read(self, workers: Mapping[PoolName, int]) -> dict[PoolName, PoolSignals]:
        signals = self.board.read([Role.PREFILL, Role.DECODE, Role.MIXED])
        page = self.gateway_metrics()
        ttft, itl = self._p90(page, TTFT), self._p90(page, ITL)
        prefill = [s for s in signals if s.role is Role.PREFILL]
        decode = [s for s in signals if s.role in (Role.DECODE, Role.MIXED)]
        return {
            PoolName.PREFILL: PoolSignals(
                workers[PoolName.PREFILL], ttft, queued_prompt_tokens=_queued(prefill)
            ),
            PoolName.DECODE: PoolSignals(
                workers[PoolName.DECODE], itl, kv_utilization=_kv_used(decode)
            ),
        }

    def close(self) -> None:
        """Close the Redis client the board reads with (the reader owns it)."""
        self.board.client.close()

    def _p90(self, page: Mapping[str, float], name: str) -> float | None:
        """The p90 of what the histogram counted since the previous read."""
        now = histogram(page, name)
        before = self._last.get(name, {})
        self._last[name] = now
        delta = sorted((b, c - before.get(b, 0.0)) for b, c in now.items())
        return bucket_quantile(0.9, delta)


def _queued(signals: Sequence[WorkerSignal]) -> int:
    return sum(s.queued_tokens for s in signals)


def _kv_used(signals: Sequence[WorkerSignal]) -> float:
    total = sum(s.total_blocks for s in signals)
    return sum(s.total_blocks - s.free_blocks for s in signals) / total if total else 0.0


class AutoscaleLoop:
    """The thread that reads, decides and scales every `interval_s` until `stop`."""

    def __init__(
        self,
        cfg: AutoscaleConfig,
        reader: SignalReader,
        sizes: Callable[[], dict[PoolName, int]],
        scale: Callable[[PoolName, int], object],
        pools: Sequence[PoolName] = tuple(PoolName),
    ) -> None:
        self.cfg = cfg
        self.reader = reader
        self.sizes = sizes
        self.scale = scale
        self.pools = tuple(pools)  # a mixed cluster scales its one pool (named decode)
        self.autoscaler = Autoscaler(cfg)
        self.last: dict[PoolName, Decision] = {}
        self.changes = 0  # resizes started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-autoscaler", daemon=True)

    def start(self) -> AutoscaleLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the loop (after a round in progress) and close the reader."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.cfg.interval_s + 5)
        self.reader.close()

    def tick(self, now: float | None = None) -> list[Decision]:
        """One read-decide-scale round; returns its decisions."""
        now = time.monotonic() if now is None else now
        signals = self.reader.read(self.sizes())
        decisions = [self.autoscaler.decide(p, signals[p], now) for p in self.pools]
        for d in decisions:
            self.last[d.pool] = d
            if d.target != d.current:
                log.info(
                    "autoscale: %s pool %d -> %d (%s; %s)", d.pool.value, d.current, d.target,
                    d.why.value, signals[d.pool],
                )  # fmt: skip
                self.changes += 1  # counted when started: a drain takes a while
                self.scale(d.pool, d.target)
        return decisions

    def status(self) -> dict[str, object]:
        return {
            "changes": self.changes,
            "pools": {
                p.value: {"size": d.current, "target": d.target, "why": d.why.value}
                for p, d in self.last.items()
            },
        }

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.interval_s):
            try:
                self.tick()
            except Exception:  # a failed round (Redis, a scrape, a scale) must not end it
                log.exception("autoscale round failed; trying again next interval")

"""Finding a cluster's capacity: the highest Poisson arrival rate that still meets the
attainment target, by a short search of timed probes.

Lifecycle: a benchmark builds a `SearchConfig` from its flags and calls
`await search_capacity(cfg, measure)`, where `measure(rate)` runs one probe (traffic at
`rate` for `cfg.window_s(rate)`: `probe_s` seconds, longer at a low rate so that a
probe holds at least `min_requests` expected arrivals and its attainment means
something) and returns its `Probe`. The search is
`CapacitySearch`, a pure state machine the driver asks for the next rate and tells each
result:

1. the first probe runs at `start_rate` (a guess);
2. while every probe met the target, the rate doubles (up to `max_rate`); while every
   probe missed, it halves (down to `min_rate`);
3. once a passing rate lies below a failing one, `bisect_steps` probes at the midpoint
   narrow the bracket;
4. the search stops there, or after `max_probes` probes in all.

The capacity is the highest passing rate below the lowest failing one: a rate that was
measured to hold, never an interpolation (a noisy pass above a failure is not trusted).
Its qualifier says how far to trust it: `bracketed` (a failing rate above it was found),
`at_least` (nothing failed: the search stopped first) or `below_min` (nothing passed;
the capacity is 0). The passing probe it came from is the run's baseline: its goodput is
what the benchmarks compare against.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


class Qualifier(enum.StrEnum):
    BRACKETED = "bracketed"  # a failing rate above the capacity was measured
    AT_LEAST = "at_least"  # every probe passed: the true capacity may be higher
    BELOW_MIN = "below_min"  # no probe passed, down to min_rate
    GIVEN = "given"  # the operator named the rate; one probe measured it


@dataclass(frozen=True)
class SearchConfig:
    start_rate: float = 1.0  # requests/s of the first probe
    probe_s: float = 20.0  # seconds of traffic per probe (at least)
    min_requests: int = 20  # expected arrivals per probe: a low rate probes for longer
    bisect_steps: int = 2  # probes spent narrowing the bracket
    max_probes: int = 7
    min_rate: float = 0.05
    max_rate: float = 64.0
    target: float = 0.9  # attainment a rate must hold

    def __post_init__(self) -> None:
        if not 0 < self.min_rate <= self.start_rate <= self.max_rate:
            raise ValueError("the search needs 0 < min_rate <= start_rate <= max_rate")
        if self.probe_s <= 0 or self.max_probes < 1 or self.bisect_steps < 0:
            raise ValueError("probe_s must be > 0, max_probes >= 1 and bisect_steps >= 0")
        if self.min_requests < 0:
            raise ValueError(f"min_requests must be >= 0, got {self.min_requests}")
        if not 0 < self.target <= 1:
            raise ValueError(f"target must be in (0, 1], got {self.target}")

    def window_s(self, rate: float) -> float:
        """How long a probe at `rate` sends: `probe_s`, or long enough for
        `min_requests` expected arrivals."""
        return max(self.probe_s, self.min_requests / rate)


@dataclass(frozen=True)
class Probe:
    """One timed run at a fixed rate. Goodput counts requests (and their output tokens)
    that met the SLO, per second of the offering window."""

    rate: float
    window_s: float  # how long it sent
    offered: int
    met: int
    attainment: float
    goodput_rps: float
    goodput_tps: float

    def passed(self, target: float) -> bool:
        return self.offered > 0 and self.attainment >= target


@dataclass(frozen=True)
class SearchResult:
    capacity_rate: float
    qualifier: Qualifier
    baseline: Probe | None  # the passing probe at capacity_rate (None: below_min)
    probes: list[Probe] = field(default_factory=list)  # in the order they ran


class CapacitySearch:
    """The search's state: which rate to probe next, and what the probes so far say."""

    def __init__(self, cfg: SearchConfig) -> None:
        self.cfg = cfg
        self.probes: list[Probe] = []
        self._bracketed_at: int | None = None  # probes run when a bracket first appeared

    def _bracket(self) -> tuple[Probe | None, Probe | None]:
        """(highest passing probe below the lowest failure, lowest failing probe)."""
        fails = [p for p in self.probes if not p.passed(self.cfg.target)]
        hi = min(fails, key=lambda p: p.rate, default=None)
        passes = [p for p in self.probes if p.passed(self.cfg.target)]
        below = [p for p in passes if hi is None or p.rate < hi.rate]
        return max(below, key=lambda p: p.rate, default=None), hi

    def record(self, probe: Probe) -> None:
        self.probes.append(probe)
        lo, hi = self._bracket()
        if lo is not None and hi is not None and self._bracketed_at is None:
            self._bracketed_at = len(self.probes)

    def next_rate(self) -> float | None:
        """The rate of the next probe, or None when the search is over."""
        cfg = self.cfg
        if not self.probes:
            return cfg.start_rate
        if len(self.probes) >= cfg.max_probes:
            return None
        lo, hi = self._bracket()
        if lo is not None and hi is not None:
            assert self._bracketed_at is not None
            if len(self.probes) - self._bracketed_at >= cfg.bisect_steps:
                return None
            return (lo.rate + hi.rate) / 2
        if hi is None:  # all passed: go up
            assert lo is not None
            return lo.rate * 2 if lo.rate * 2 <= cfg.max_rate else None
        return hi.rate / 2 if hi.rate / 2 >= cfg.min_rate else None  # all failed: go down

    def result(self) -> SearchResult:
        lo, hi = self._bracket()
        if lo is None:
            return SearchResult(0.0, Qualifier.BELOW_MIN, None, list(self.probes))
        qualifier = Qualifier.AT_LEAST if hi is None else Qualifier.BRACKETED
        return SearchResult(lo.rate, qualifier, lo, list(self.probes))


Measure = Callable[[float], Awaitable[Probe]]


async def search_capacity(cfg: SearchConfig, measure: Measure) -> SearchResult:
    """Run probes until the search is over; `measure(rate)` runs one."""
    search = CapacitySearch(cfg)
    while (rate := search.next_rate()) is not None:
        search.record(await measure(rate))
    return search.result()


async def measure_given(rate: float, measure: Measure) -> SearchResult:
    """No search: one probe at the operator's rate, which is the capacity whatever its
    attainment (the probe's is reported beside it)."""
    probe = await measure(rate)
    return SearchResult(rate, Qualifier.GIVEN, probe, [probe])

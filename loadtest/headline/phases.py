"""The phases of a shifting workload: chat, then long-prompt-heavy, then chat again (or
whatever `--phases` says), each a fixed span of Poisson arrivals at its own rate.

Lifecycle: `parse_phases("0:0.5:120,0.5:0.15:120,...")` turns the flag into `Phase`s laid
end to end on one clock (each `LONG_FRACTION:RATE:SECONDS`). For each point of the run,
`schedule_requests(phases, scale, traffic, synth, stream)` draws the whole request
sequence up front: per phase, Poisson arrival times at `rate * scale` within the phase's
span and as many requests of the long-prompt mix at the phase's long fraction
(`traffic.make_requests`; long prompts spread evenly through the phase), each stamped
with its arrival time (`BenchRequest.at_s`), so the runner replays the sequence on its
own clock and every deployment gets the same one. `split_by_phase` then sorts a run's
records back into phases by request id: a request belongs to the phase it was sent in,
however late it finished.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from loadtest.harness.metrics import RequestRecord
from loadtest.harness.request_spec import BenchRequest
from loadtest.harness.traffic import TrafficConfig, make_requests
from loadtest.workloads.prompt_text import TextSynth

#: Request streams of the phases of one point: stream + phase index (fewer phases than this).
MAX_PHASES = 100


@dataclass(frozen=True)
class Phase:
    long_fraction: float  # share of long prompts (0: chat only)
    rate: float  # offered requests/s at rate scale 1
    start_s: float  # from the run's start
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def name(self) -> str:
        return "chat" if self.long_fraction == 0 else f"{self.long_fraction:.0%} long"


def parse_phases(text: str) -> list[Phase]:
    """'0:0.5:120,0.5:0.15:120' -> the phases, end to end from t = 0."""
    phases: list[Phase] = []
    start = 0.0
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            fraction, rate, seconds = (float(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(
                f"phases: expected LONG_FRACTION:RATE:SECONDS, comma-separated, got {part!r}"
            ) from None
        if not 0.0 <= fraction <= 1.0 or rate <= 0 or seconds <= 0:
            raise ValueError(f"phases: {part!r} needs a fraction in [0, 1], rate and seconds > 0")
        phases.append(Phase(fraction, rate, start, start + seconds))
        start += seconds
    if not phases or len(phases) >= MAX_PHASES:
        raise ValueError(f"phases: 1 to {MAX_PHASES - 1} phases, got {text!r}")
    return phases


def arrival_times(phase: Phase, rate: float, rng: random.Random) -> list[float]:
    """Poisson arrivals at `rate` within the phase's span (times from the run's start)."""
    times, t = [], phase.start_s
    while (t := t + rng.expovariate(rate)) < phase.end_s:
        times.append(t)
    return times


@dataclass(frozen=True)
class ScheduledRequests:
    """One point's request sequence, in arrival order, and the phase of each request."""

    requests: list[BenchRequest]
    phase_of: dict[str, int]  # request id -> phase index

    def mean_rate(self, phases: Sequence[Phase]) -> float:
        """Requests per second over the whole schedule (for the progress label)."""
        return len(self.requests) / phases[-1].end_s


def schedule_requests(
    phases: Sequence[Phase], scale: float, traffic: TrafficConfig, synth: TextSynth, stream: int
) -> ScheduledRequests:
    """Every phase's requests at `rate * scale`, stamped with their arrival times.
    Request ids carry the stream (`stream + phase index`), so no two phases or points
    share one, nor their unique user text."""
    requests: list[BenchRequest] = []
    phase_of: dict[str, int] = {}
    for k, phase in enumerate(phases):
        times = arrival_times(phase, phase.rate * scale, random.Random(f"shift/{stream}/{k}"))
        mix = replace(traffic, workload="long_mix", long_fraction=phase.long_fraction)
        for req, at in zip(make_requests(mix, synth, len(times), stream + k), times, strict=True):
            requests.append(replace(req, at_s=at))
            phase_of[req.request_id] = k
    return ScheduledRequests(requests, phase_of)


def split_by_phase(
    records: Sequence[RequestRecord], phase_of: dict[str, int], count: int
) -> list[list[RequestRecord]]:
    """The records of each of `count` phases, in send order; a record of a request
    outside the schedule is an error (it would be counted nowhere)."""
    out: list[list[RequestRecord]] = [[] for _ in range(count)]
    for rec in records:
        if rec.request_id not in phase_of:
            raise ValueError(f"record {rec.request_id!r} is of no phase of this schedule")
        out[phase_of[rec.request_id]].append(rec)
    return out

"""Traffic of the flow-control benchmarks: who sends, in which class, through which
gateway, at what rate.

Lifecycle: a benchmark describes one phase as `FlowStream`s (a tenant sending one class
through one gateway as a Poisson process at `rate` requests/s); `schedule(streams, ...)`
draws every stream's arrivals over the phase independently (so a class mix is the
superposition of per-class processes, itself Poisson at the total rate), gives each
arrival a fresh prompt of `prompt_tokens` random words and merges them by send time.
The flow runner then sends them. Every prompt is unique, so no request rides another's
prefix cache: each costs a full prefill, which is what capacity means here.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.priority import Priority
from loadtest.harness.request_spec import BenchRequest
from loadtest.workloads.prompt_text import TextSynth


@dataclass(frozen=True)
class FlowStream:
    tenant: str
    priority: Priority
    rate: float  # requests/s
    gateway: int = 0  # index into the cluster's gateway addresses

    def __post_init__(self) -> None:
        if self.rate < 0 or self.gateway < 0:
            raise ValueError(f"{self.tenant}: rate and gateway must be >= 0")


@dataclass(frozen=True)
class FlowRequest:
    spec: BenchRequest
    tenant: str
    priority: Priority
    at_s: float  # send time from the phase's start
    gateway: int = 0


@dataclass(frozen=True)
class RequestShape:
    prompt_tokens: int = 200
    output_tokens: int = 32

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("prompt_tokens and output_tokens must be >= 1")


def poisson_offsets(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, duration_s) of a Poisson process (exponential gaps)."""
    if rate <= 0:
        return []
    offsets, t = [], rng.expovariate(rate)
    while t < duration_s:
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def class_mix(
    total_rate: float, mix: Mapping[Priority, float], tenants: Mapping[Priority, str]
) -> list[FlowStream]:
    """One stream per class with a share of `total_rate`, sent by that class's tenant."""
    total = sum(mix.values())
    return [FlowStream(tenants[p], p, total_rate * share / total) for p, share in mix.items()]


def schedule(
    streams: Sequence[FlowStream],
    duration_s: float,
    synth: TextSynth,
    shape: RequestShape,
    seed: str,
) -> list[FlowRequest]:
    """Every stream's arrivals over `duration_s`, merged by send time. `seed` names the
    phase, so two phases never draw the same gaps or prompts."""
    out: list[FlowRequest] = []
    for i, stream in enumerate(streams):
        rng = random.Random(f"{seed}/{i}/{stream.tenant}/{stream.priority.label}")
        for j, at in enumerate(poisson_offsets(stream.rate, duration_s, rng)):
            spec = BenchRequest(
                request_id=f"{seed}-{i}-{j}",
                kind=stream.priority.label,
                max_tokens=shape.output_tokens,
                prompt=synth.text(rng, shape.prompt_tokens),
                tenant=stream.tenant,
            )
            out.append(FlowRequest(spec, stream.tenant, stream.priority, at, stream.gateway))
    out.sort(key=lambda r: r.at_s)
    return out

"""Metrics of a flow-control phase: per class and per tenant, refusals, goodput and
fairness.

Lifecycle: a phase's `FlowRecord`s are reduced once it is over: `class_stats` for each
class (offered, served, attainment, refusals by status, reason and timing, TTFT of the
served), `tenant_stats` for each tenant, `goodput` for the phase, and `jain_index` over
the tenants' served KV-block-seconds. Definitions:

- offered: requests sent in the phase. served: completed (every token streamed).
- met: served with its first token within its class's TTFT budget and, when the run
  sets an ITL SLO, the p90 of its own token gaps within that (`FlowSlo.met`);
  attainment = met / offered (a refusal or an error is a miss).
- ITL: the gaps between a served request's tokens (`FlowRecord.token_gaps_s`), pooled
  per class.
- goodput: met requests (and their output tokens) per second of the phase's sending
  window, so that the drain after it is not what is measured.
- refusal latency: send to refusal; timing per `FlowSlo.refusal_timing`.
- KV-block-seconds: `FlowRecord.kv_block_seconds` (blocks at the end x first token to
  end), summed per tenant over its served requests.
- Jain's index: (sum x)^2 / (n sum x^2) over the tenants' x = service / weight: 1 when
  all got the same, 1/n when one got everything.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from engine.priority import Priority
from loadtest.flow.record import FlowRecord
from loadtest.flow.slo import FlowSlo, RefusalTiming
from loadtest.harness.metrics import percentile


@dataclass(frozen=True)
class Latency:
    """Percentiles and maximum in milliseconds (NaN when there was nothing)."""

    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of_seconds(cls, values: Iterable[float | None]) -> Latency:
        ms = [1000.0 * v for v in values if v is not None]
        top = max(ms) if ms else math.nan
        return cls(len(ms), percentile(ms, 50), percentile(ms, 90), percentile(ms, 99), top)


@dataclass(frozen=True)
class ClassStats:
    priority: str  # the class's label
    budget_s: float
    offered: int
    served: int
    met: int
    attainment: float
    refused: int
    refused_by_status: dict[str, int]  # "429" / "503" -> count
    refused_by_reason: dict[str, int]  # RefusalReason value -> count
    refusal_timing: dict[str, int]  # RefusalTiming value -> count
    late_refusals: int  # refusals after budget x (1 + tolerance) + slack
    refusal_latency: Latency
    retry_after_s_max: float  # the longest retry hint given (NaN: none)
    errors: dict[str, int]  # failures that were not refusals, by gRPC code
    ttft: Latency  # of the served
    served_past_budget: int  # served with TTFT > budget x (1 + tolerance)
    itl: Latency  # every token gap of the served


@dataclass(frozen=True)
class TenantStats:
    tenant: str
    offered: int
    served: int
    met: int
    attainment: float
    refused: int
    kv_block_seconds: float
    ttft: Latency


@dataclass(frozen=True)
class Goodput:
    window_s: float
    met: int
    requests_per_s: float
    tokens_per_s: float  # output tokens of the met requests


def share(n: float, total: float) -> float:
    return n / total if total else 0.0


def class_stats(records: Sequence[FlowRecord], priority: Priority, slo: FlowSlo) -> ClassStats:
    mine = [r for r in records if r.priority == priority]
    served = [r for r in mine if r.completed]
    met = sum(slo.met(priority, r.completed, r.ttft_s, r.itl_p90_s) for r in mine)
    refused = [r for r in mine if r.refusal is not None]
    timing = Counter(
        slo.refusal_timing(priority, r.refusal_latency_s or 0.0).value for r in refused
    )
    hints = [r.refusal.retry_after_s for r in refused if r.refusal and r.refusal.retry_after_s]
    return ClassStats(
        priority=priority.label,
        budget_s=slo.budget_s(priority),
        offered=len(mine),
        served=len(served),
        met=met,
        attainment=share(met, len(mine)),
        refused=len(refused),
        refused_by_status=dict(Counter(str(r.refusal.status) for r in refused if r.refusal)),
        refused_by_reason=dict(Counter(r.refusal.reason.value for r in refused if r.refusal)),
        refusal_timing=dict(timing),
        late_refusals=timing.get(RefusalTiming.LATE.value, 0),
        refusal_latency=Latency.of_seconds(r.refusal_latency_s for r in refused),
        retry_after_s_max=max(hints, default=math.nan),
        errors=dict(Counter(r.code for r in mine if r.failed)),
        ttft=Latency.of_seconds(r.ttft_s for r in served),
        served_past_budget=sum(slo.served_late(priority, r.ttft_s) for r in served),
        itl=Latency.of_seconds(g for r in served for g in r.token_gaps_s),
    )


def all_class_stats(records: Sequence[FlowRecord], slo: FlowSlo) -> list[ClassStats]:
    """Every class that sent something, highest first."""
    sent = {r.priority for r in records}
    return [class_stats(records, p, slo) for p in sorted(sent, reverse=True)]


def tenant_stats(
    records: Sequence[FlowRecord], tenant: str, slo: FlowSlo, block_size: int
) -> TenantStats:
    mine = [r for r in records if r.tenant == tenant]
    served = [r for r in mine if r.completed]
    met = sum(slo.met(r.priority, r.completed, r.ttft_s, r.itl_p90_s) for r in mine)
    return TenantStats(
        tenant=tenant,
        offered=len(mine),
        served=len(served),
        met=met,
        attainment=share(met, len(mine)),
        refused=sum(r.refused for r in mine),
        kv_block_seconds=sum(r.kv_block_seconds(block_size) for r in served),
        ttft=Latency.of_seconds(r.ttft_s for r in served),
    )


def goodput(records: Sequence[FlowRecord], slo: FlowSlo, window_s: float) -> Goodput:
    met = [r for r in records if slo.met(r.priority, r.completed, r.ttft_s, r.itl_p90_s)]
    tokens = sum(r.output_tokens for r in met)
    return Goodput(window_s, len(met), share(len(met), window_s), share(tokens, window_s))


def attainment(records: Sequence[FlowRecord], slo: FlowSlo) -> float:
    met = sum(slo.met(r.priority, r.completed, r.ttft_s, r.itl_p90_s) for r in records)
    return share(met, len(records))


def jain_index(values: Sequence[float], weights: Sequence[float] | None = None) -> float:
    """Jain's fairness index of `values` (each divided by its weight); NaN when there
    is nothing to share (no values, or all zero)."""
    weights = weights or [1.0] * len(values)
    if len(weights) != len(values) or min(weights, default=1.0) <= 0:
        raise ValueError("one weight > 0 per value")
    xs = [v / w for v, w in zip(values, weights, strict=True)]
    squares = sum(x * x for x in xs)
    if not xs or squares == 0:
        return math.nan
    return sum(xs) ** 2 / (len(xs) * squares)


def kv_share_index(stats: Sequence[TenantStats], weights: Mapping[str, float]) -> float:
    """Jain's index of the tenants' served KV-block-seconds, by their weights."""
    return jain_index(
        [s.kv_block_seconds for s in stats], [weights.get(s.tenant, 1.0) for s in stats]
    )

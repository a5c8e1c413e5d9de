"""One phase of a flow-control benchmark: draw its traffic, send it, summarise it; and
the capacity search built from such phases.

Lifecycle: `run_phase(fc, streams, duration_s, ...)` draws the streams' requests
(`traffic.schedule`), sends them through the cluster's gateways (`run_flow`) and
returns the records once the last stream has ended; `summarize_phase` reduces them to a
`PhaseSummary` (per class, per tenant, goodput, Jain's index of KV-block-seconds).
`find_capacity` runs the capacity search (`capacity_search`) with one phase per probe,
`streams_at(rate)` saying what a probe at `rate` sends; with `cfg.capacity_rate` set it
runs one probe at that rate instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from loadtest.flow.cluster import BLOCK_SIZE, FlowCluster
from loadtest.flow.config import FlowBenchConfig
from loadtest.flow.metrics import (
    ClassStats,
    Goodput,
    TenantStats,
    all_class_stats,
    attainment,
    goodput,
    kv_share_index,
    tenant_stats,
)
from loadtest.flow.record import FlowRecord
from loadtest.flow.runner import FlowPace, run_flow
from loadtest.flow.slo import FlowSlo
from loadtest.flow.traffic import FlowStream, schedule
from loadtest.harness.capacity_search import Probe, SearchResult, measure_given, search_capacity
from loadtest.workloads.prompt_text import TextSynth

Progress = Callable[[str], None]


@dataclass(frozen=True)
class StreamSpec:
    """A stream as the report names it (the class by its label)."""

    tenant: str
    priority: str
    rate: float
    gateway: int

    @classmethod
    def of(cls, s: FlowStream) -> StreamSpec:
        return cls(s.tenant, s.priority.label, round(s.rate, 4), s.gateway)


@dataclass(frozen=True)
class PhaseSummary:
    label: str
    duration_s: float  # the sending window
    streams: list[StreamSpec]
    offered: int
    attainment: float
    goodput: Goodput
    classes: list[ClassStats]
    tenants: list[TenantStats]
    kv_jain_index: float  # over the phase's tenants, by weight


async def run_phase(
    fc: FlowCluster,
    streams: Sequence[FlowStream],
    duration_s: float,
    cfg: FlowBenchConfig,
    synth: TextSynth,
    seed: str,
) -> list[FlowRecord]:
    requests = schedule(streams, duration_s, synth, cfg.shape, seed)
    pace = FlowPace(duration_s=duration_s, request_timeout_s=cfg.request_timeout_s)
    return await run_flow(fc.addresses, fc.keys, requests, pace)


def summarize_phase(
    label: str,
    streams: Sequence[FlowStream],
    duration_s: float,
    records: Sequence[FlowRecord],
    slo: FlowSlo,
    weights: Mapping[str, float],
) -> PhaseSummary:
    tenants = sorted({s.tenant for s in streams})
    per_tenant = [tenant_stats(records, t, slo, BLOCK_SIZE) for t in tenants]
    return PhaseSummary(
        label=label,
        duration_s=duration_s,
        streams=[StreamSpec.of(s) for s in streams],
        offered=len(records),
        attainment=attainment(records, slo),
        goodput=goodput(records, slo, duration_s),
        classes=all_class_stats(records, slo),
        tenants=per_tenant,
        kv_jain_index=kv_share_index(per_tenant, weights),
    )


def probe_of(rate: float, records: Sequence[FlowRecord], slo: FlowSlo, window_s: float) -> Probe:
    g = goodput(records, slo, window_s)
    return Probe(rate, window_s, len(records), g.met, attainment(records, slo),
                 g.requests_per_s, g.tokens_per_s)  # fmt: skip


async def find_capacity(
    fc: FlowCluster,
    cfg: FlowBenchConfig,
    synth: TextSynth,
    streams_at: Callable[[float], list[FlowStream]],
    progress: Progress,
) -> SearchResult:
    """The highest rate holding `cfg.attainment_target` (or `cfg.capacity_rate`)."""
    slo = cfg.slo()
    count = 0

    async def measure(rate: float) -> Probe:
        nonlocal count
        count += 1
        window = cfg.search.window_s(rate)
        records = await run_phase(fc, streams_at(rate), window, cfg, synth, f"probe{count}")
        probe = probe_of(rate, records, slo, window)
        progress(
            f"probe {count} at {rate:.3f} req/s for {window:.0f} s: {probe.offered} sent, "
            f"attainment {probe.attainment:.2f}, goodput {probe.goodput_rps:.3f} req/s"
        )
        return probe

    if cfg.capacity_rate is not None:
        return await measure_given(cfg.capacity_rate, measure)
    return await search_capacity(cfg.search, measure)

"""Flow-control metrics: which failures are refusals and why, when a refusal is on time,
attainment and goodput per class and tenant, KV-block-seconds and Jain's index."""

from __future__ import annotations

import math
import random

import pytest

from engine.priority import Priority
from loadtest.flow.metrics import class_stats, goodput, jain_index, tenant_stats
from loadtest.flow.record import FlowRecord
from loadtest.flow.refusal import Refusal, metadata_dict, reason_of, refusal_of
from loadtest.flow.slo import FlowSlo, RefusalTiming
from loadtest.flow.traffic import FlowStream, RequestShape, class_mix, poisson_offsets, schedule
from loadtest.workloads.prompt_text import TextSynth
from services.common.status import RefusalReason

SLO = FlowSlo.of({}, immediate_s=0.05, tolerance=0.1, slack_s=0.2)  # 10 / 5 / 2 s
STD, CRIT, SHED = Priority.STANDARD, Priority.CRITICAL, Priority.SHEDDABLE


def served(priority: Priority, ttft: float, tenant: str = "t", tokens: int = 32) -> FlowRecord:
    rec = FlowRecord("r", tenant, priority, 0, sent_s=1.0, first_token_s=1.0 + ttft)
    rec.finished_s, rec.prompt_tokens, rec.output_tokens = 1.0 + ttft + 2.0, 200, tokens
    return rec


def refused(priority: Priority, after: float, status: int = 503,
            reason: RefusalReason = RefusalReason.BUDGET) -> FlowRecord:  # fmt: skip
    code = "UNAVAILABLE" if status == 503 else "RESOURCE_EXHAUSTED"
    rec = FlowRecord("r", "t", priority, 0, sent_s=1.0, code=code)
    rec.refusal, rec.finished_s = Refusal(status, reason, 1.0), 1.0 + after
    return rec


# -- refusals -------------------------------------------------------------------------


def test_the_reason_is_the_gateways_trailing_metadata() -> None:
    assert reason_of({"refusal-reason": "room_full"}) == RefusalReason.ROOM_FULL
    assert reason_of({"refusal-reason": "stream_cap"}) == RefusalReason.STREAM_CAP
    assert reason_of({"refusal-reason": "new_one"}) is None
    assert reason_of({"retry-after-ms": "1000"}) is None


def test_only_early_429_and_503_with_a_reason_are_refusals() -> None:
    meta = metadata_dict([("retry-after-ms", "2500"), ("refusal-reason", b"budget")])
    refusal = refusal_of("UNAVAILABLE", "overloaded: ...", meta, got_token=False)
    assert refusal == Refusal(503, RefusalReason.BUDGET, 2.5)
    cap = refusal_of("RESOURCE_EXHAUSTED", "max_streams: 2", {"refusal-reason": "stream_cap"},
                     got_token=False)  # fmt: skip
    assert cap == Refusal(429, RefusalReason.STREAM_CAP, None)
    assert refusal_of("UNAVAILABLE", "overloaded: ...", meta, got_token=True) is None
    assert refusal_of("DEADLINE_EXCEEDED", "overloaded: ...", meta, got_token=False) is None
    assert refusal_of("UNAVAILABLE", "no decode worker registered", {}, got_token=False) is None


def test_refusal_timing_against_the_class_budget() -> None:
    assert SLO.refusal_timing(STD, 0.03) == RefusalTiming.IMMEDIATE
    assert SLO.refusal_timing(STD, 2.0) == RefusalTiming.MID_WAIT
    assert SLO.refusal_timing(STD, 4.6) == RefusalTiming.AT_BUDGET
    assert SLO.refusal_timing(STD, 5.0 * 1.1 + 0.19) == RefusalTiming.AT_BUDGET
    assert SLO.refusal_timing(STD, 5.0 * 1.1 + 0.21) == RefusalTiming.LATE
    assert SLO.refusal_timing(SHED, 2.5) == RefusalTiming.LATE
    assert SLO.refusal_timing(CRIT, 10.5) == RefusalTiming.AT_BUDGET


def test_budgets_default_to_the_gateways_and_take_overrides() -> None:
    assert [SLO.budget_s(p) for p in (CRIT, STD, SHED)] == [10.0, 5.0, 2.0]
    slo = FlowSlo.of({STD: 3.0, CRIT: None}, 0.05, 0.1, 0.2)
    assert slo.budget_s(STD) == 3.0 and slo.budget_s(CRIT) == 10.0
    with pytest.raises(ValueError):
        FlowSlo.of({STD: -1.0}, 0.05, 0.1, 0.2)


# -- per class, per tenant, goodput ---------------------------------------------------


def test_class_stats_count_every_ending() -> None:
    failed = FlowRecord("r", "t", STD, 0, sent_s=0.0, code="DEADLINE_EXCEEDED", finished_s=60.0)
    records = [
        served(STD, 1.0), served(STD, 5.2), served(STD, 6.0),  # met, missed, past budget
        refused(STD, 0.01), refused(STD, 5.1), refused(STD, 9.0),
        refused(STD, 0.02, 429, RefusalReason.STREAM_CAP), failed, served(CRIT, 1.0),
    ]  # fmt: skip
    c = class_stats(records, STD, SLO)
    assert (c.offered, c.served, c.met, c.refused) == (8, 3, 1, 4)
    assert c.attainment == pytest.approx(1 / 8)
    assert c.refused_by_status == {"503": 3, "429": 1}
    assert c.refused_by_reason == {"budget": 3, "stream_cap": 1}
    assert c.refusal_timing == {"immediate": 2, "at_budget": 1, "late": 1}
    assert c.late_refusals == 1
    assert c.served_past_budget == 1  # 6.0 > 5.5; 5.2 is within the tolerance
    assert c.errors == {"DEADLINE_EXCEEDED": 1}
    assert c.refusal_latency.max_ms == pytest.approx(9000.0)
    assert c.ttft.count == 3 and c.ttft.p50_ms == pytest.approx(5200.0)


def test_goodput_is_per_second_of_the_window() -> None:
    records = [served(STD, 1.0), served(STD, 1.0, tokens=10), served(SHED, 3.0), refused(STD, 0)]
    g = goodput(records, SLO, window_s=10.0)
    assert (g.met, g.requests_per_s, g.tokens_per_s) == (2, 0.2, 4.2)
    assert goodput([], SLO, 10.0).requests_per_s == 0.0


def test_kv_block_seconds_of_a_tenant() -> None:
    a = served(STD, 1.0, tenant="a", tokens=40)  # (200 + 40) / 16 = 15 blocks x 2 s
    b = served(STD, 1.0, tenant="a", tokens=41)  # 16 blocks x 2 s
    assert a.kv_block_seconds(16) == pytest.approx(30.0)
    stats = tenant_stats([a, b, refused(STD, 0), served(STD, 1, tenant="b")], "a", SLO, 16)
    assert stats.kv_block_seconds == pytest.approx(62.0)
    assert (stats.offered, stats.served, stats.met) == (2, 2, 2)


def test_jain_index() -> None:
    assert jain_index([5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert jain_index([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain_index([1.0, 2.0, 3.0]) == pytest.approx(36 / 42)
    assert jain_index([2.0, 1.0], weights=[2.0, 1.0]) == pytest.approx(1.0)
    assert math.isnan(jain_index([0.0, 0.0]))
    assert math.isnan(jain_index([]))
    with pytest.raises(ValueError):
        jain_index([1.0], weights=[0.0])


# -- traffic --------------------------------------------------------------------------


def test_poisson_offsets_have_the_rate() -> None:
    offsets = poisson_offsets(5.0, 200.0, random.Random(1))
    assert all(0 <= t < 200 for t in offsets) and offsets == sorted(offsets)
    assert 900 < len(offsets) < 1100
    assert poisson_offsets(0.0, 10.0, random.Random(1)) == []


def test_schedule_merges_streams_with_their_class_and_gateway() -> None:
    synth = TextSynth([f" word{i:03d}" for i in range(64)])
    streams = class_mix(4.0, {CRIT: 0.25, SHED: 0.75}, {CRIT: "c", SHED: "s"})
    assert [(s.tenant, s.rate) for s in streams] == [("c", 1.0), ("s", 3.0)]
    streams.append(FlowStream("g", STD, 1.0, gateway=1))
    reqs = schedule(streams, 30.0, synth, RequestShape(20, 8), "p1")
    assert [r.at_s for r in reqs] == sorted(r.at_s for r in reqs)
    assert {(r.tenant, r.priority, r.gateway) for r in reqs} == {
        ("c", CRIT, 0), ("s", SHED, 0), ("g", STD, 1)}  # fmt: skip
    assert all(r.spec.max_tokens == 8 for r in reqs)
    assert len({r.spec.prompt for r in reqs}) == len(reqs)  # no shared prefixes
    again = schedule(streams, 30.0, synth, RequestShape(20, 8), "p1")
    assert [r.at_s for r in again] == [r.at_s for r in reqs]
    other = schedule(streams, 30.0, synth, RequestShape(20, 8), "p2")
    assert [r.at_s for r in other] != [r.at_s for r in reqs]

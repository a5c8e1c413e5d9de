"""Metric math of the load tester: percentiles, SLO checks, goodput, attainment, capacity."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadtest.harness.metrics import (
    Dist,
    RequestRecord,
    Slo,
    itl_met,
    max_rate_at,
    percentile,
    slo_met,
    summarize,
    ttft_met,
)


def _rec(
    sent: float,
    ttft: float | None,
    gaps: list[float],
    *,
    code: str = "OK",
    prompt: int = 100,
    cached: int = 0,
    kind: str = "chat",
) -> RequestRecord:
    first = None if ttft is None else sent + ttft
    end = (first if first is not None else sent) + sum(gaps)
    return RequestRecord(
        request_id=f"r{sent}",
        kind=kind,
        sent_s=sent,
        code=code,
        first_token_s=first,
        finished_s=end,
        token_gaps_s=list(gaps),
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=0 if ttft is None else len(gaps) + 1,
    )


@pytest.mark.parametrize("q", [0, 1, 10, 33.3, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q: float) -> None:
    values = [5.0, 1.0, 9.5, 3.25, 7.0, 2.0, 8.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([4.0], 99) == 4.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_slo_budget_grows_with_prompt_tokens() -> None:
    slo = Slo(ttft_ms=1000, ttft_ms_per_token=10, itl_ms=100)
    assert slo.ttft_limit_s(0) == pytest.approx(1.0)
    assert slo.ttft_limit_s(4000) == pytest.approx(41.0)
    with pytest.raises(ValueError):
        Slo(itl_quantile=0.0)


def test_ttft_and_itl_checks() -> None:
    slo = Slo(ttft_ms=1000, ttft_ms_per_token=1, itl_ms=100, itl_quantile=0.9)
    # 100 prompt tokens -> budget 1.1 s
    assert ttft_met(_rec(0, 1.05, []), slo) and not ttft_met(_rec(0, 1.2, []), slo)
    # one slow gap of 20: p90 of the gaps stays under 100 ms; three slow gaps do not
    fast = [0.05] * 19
    assert itl_met(_rec(0, 0.1, [*fast, 0.5]), slo)
    assert not itl_met(_rec(0, 0.1, [*fast[:17], 0.5, 0.5, 0.5]), slo)
    assert not itl_met(_rec(0, 0.1, [*fast, 0.5]), Slo(itl_ms=100, itl_quantile=1.0))
    assert itl_met(_rec(0, 0.1, []), slo)  # a single token has no gap to miss
    failed = _rec(0, 0.1, [0.01], code="UNAVAILABLE")
    assert not ttft_met(failed, slo) and not itl_met(failed, slo) and not slo_met(failed, slo)


def test_tpot_and_e2e() -> None:
    r = _rec(1.0, 0.5, [0.1, 0.2, 0.3])
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2e_s == pytest.approx(1.1)
    assert r.tpot_s == pytest.approx(0.6 / 3)
    assert _rec(0, 0.5, []).tpot_s is None


def test_summarize_goodput_attainment_and_counts() -> None:
    slo = Slo(ttft_ms=1000, itl_ms=100)
    records = [
        _rec(0.0, 0.5, [0.05, 0.05], prompt=100, cached=50),  # meets both
        _rec(1.0, 2.0, [0.05], prompt=100, cached=0),  # TTFT miss
        _rec(2.0, 0.2, [0.5, 0.5], prompt=200, cached=100, kind="long"),  # ITL miss
        _rec(3.0, None, [], code="DEADLINE_EXCEEDED"),
        _rec(4.0, None, [], code="UNAVAILABLE"),
        _rec(5.0, 0.1, [0.01], prompt=100, cached=100),  # meets both, ends at 5.11
    ]
    m = summarize(records, slo)
    assert (m.sent, m.ok, m.errors) == (6, 4, 2)
    assert m.errors_by_code == {"DEADLINE_EXCEEDED": 1, "UNAVAILABLE": 1}
    assert m.duration_s == pytest.approx(5.11)
    assert m.slo_attainment == pytest.approx(2 / 6)
    assert m.ttft_attainment == pytest.approx(3 / 6)
    assert m.itl_attainment == pytest.approx(3 / 6)
    assert m.goodput == pytest.approx(2 / 5.11)
    assert m.request_throughput == pytest.approx(4 / 5.11)
    assert m.prefix_hit_ratio == pytest.approx(250 / 500)
    assert m.output_tokens == 3 + 2 + 3 + 2
    assert m.itl_ms.count == 6 and m.ttft_ms.count == 4
    assert m.by_kind["long"].sent == 1 and m.by_kind["long"].slo_attainment == 0.0
    assert m.by_kind["chat"].sent == 5 and m.by_kind["chat"].ok == 3


def test_summarize_nothing_sent() -> None:
    m = summarize([], Slo())
    assert m.sent == 0 and m.goodput == 0.0 and m.slo_attainment == 0.0
    assert math.isnan(m.ttft_ms.p50) and Dist.of_seconds([]).count == 0


def test_max_rate_at_interpolates_the_crossing() -> None:
    points = [(0.2, 0.95), (0.1, 1.0), (0.3, 0.85), (0.4, 0.5)]
    rate, how = max_rate_at(points, 0.9)
    assert how == "interpolated" and rate == pytest.approx(0.25)
    assert max_rate_at([(0.1, 0.8), (0.2, 0.95)], 0.9) == (0.0, "below_sweep")
    assert max_rate_at([(0.1, 0.99), (0.2, 0.95)], 0.9) == (0.2, "at_least")
    assert max_rate_at([], 0.9) == (0.0, "below_sweep")

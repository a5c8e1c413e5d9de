"""The capacity search: doubling, halving, bisection, its stopping rules, and the
capacity it reports from noisy or one-sided probes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from loadtest.harness.capacity_search import (
    CapacitySearch,
    Probe,
    Qualifier,
    SearchConfig,
    SearchResult,
    measure_given,
    search_capacity,
)


def probe(rate: float, attainment: float) -> Probe:
    return Probe(rate, 20.0, 20, round(20 * attainment), attainment, rate * attainment, 0.0)


def run(cfg: SearchConfig, holds: Callable[[float], float]) -> tuple[list[float], SearchResult]:
    rates: list[float] = []

    async def measure(rate: float) -> Probe:
        rates.append(rate)
        return probe(rate, holds(rate))

    result = asyncio.run(search_capacity(cfg, measure))
    return rates, result


def step(capacity: float) -> Callable[[float], float]:
    return lambda rate: 1.0 if rate <= capacity else 0.5


def test_doubles_until_a_failure_then_bisects() -> None:
    rates, result = run(SearchConfig(start_rate=1.0, bisect_steps=2), step(2.7))
    assert rates == [1.0, 2.0, 4.0, 3.0, 2.5]
    assert result.capacity_rate == 2.5
    assert result.qualifier == Qualifier.BRACKETED
    assert result.baseline is not None and result.baseline.rate == 2.5


def test_halves_until_a_pass() -> None:
    rates, result = run(SearchConfig(start_rate=4.0, bisect_steps=1), step(1.2))
    assert rates == [4.0, 2.0, 1.0, 1.5]
    assert result.capacity_rate == 1.0


def test_stops_at_the_ceiling_and_at_max_probes() -> None:
    rates, result = run(SearchConfig(start_rate=1.0, max_rate=4.0), step(100))
    assert rates == [1.0, 2.0, 4.0]
    assert result.qualifier == Qualifier.AT_LEAST
    assert result.capacity_rate == 4.0
    rates, _ = run(SearchConfig(start_rate=1.0, max_probes=2), step(100))
    assert rates == [1.0, 2.0]


def test_nothing_passes_down_to_the_floor() -> None:
    rates, result = run(SearchConfig(start_rate=1.0, min_rate=0.3), step(0.1))
    assert rates == [1.0, 0.5]
    assert result.qualifier == Qualifier.BELOW_MIN
    assert result.capacity_rate == 0.0
    assert result.baseline is None


def test_a_noisy_pass_above_a_failure_is_not_the_capacity() -> None:
    search = CapacitySearch(SearchConfig(start_rate=1.0, bisect_steps=1))
    for rate, att in ((1.0, 0.95), (2.0, 0.5), (1.5, 0.2)):
        search.record(probe(rate, att))
    search.record(probe(3.0, 0.99))  # noise: passes above two failures
    result = search.result()
    assert result.capacity_rate == 1.0 and result.qualifier == Qualifier.BRACKETED


def test_an_empty_probe_does_not_pass() -> None:
    assert not Probe(1.0, 20.0, 0, 0, 0.0, 0.0, 0.0).passed(0.9)
    assert Probe(1.0, 20.0, 10, 9, 0.9, 0.9, 0.0).passed(0.9)


def test_a_low_rate_probes_for_longer() -> None:
    cfg = SearchConfig(probe_s=20.0, min_requests=20)
    assert cfg.window_s(4.0) == 20.0 and cfg.window_s(0.25) == 80.0
    assert SearchConfig(probe_s=20.0, min_requests=0).window_s(0.25) == 20.0


def test_a_given_rate_is_one_probe() -> None:
    async def measure(rate: float) -> Probe:
        return probe(rate, 0.5)

    result = asyncio.run(measure_given(2.0, measure))
    assert result.capacity_rate == 2.0 and result.qualifier == Qualifier.GIVEN
    assert len(result.probes) == 1


@pytest.mark.parametrize(
    "kwargs",
    [{"start_rate": 0.01}, {"start_rate": 100.0}, {"probe_s": 0}, {"target": 1.5},
     {"max_probes": 0}],
)  # fmt: skip
def test_bad_search_configs_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SearchConfig(**kwargs)  # type: ignore[arg-type]

"""The bench's cluster price: node costs by role, their sum over the workers, and the
cost per million output tokens at the SLO in the report."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loadtest.harness.bench_report import PointResult, cost_lines
from loadtest.harness.cost import ClusterCost, NodeCosts
from loadtest.harness.metrics import Slo, summarize


def test_one_price_for_every_role_or_one_per_role() -> None:
    assert NodeCosts.parse("2").per_hour({"prefill": 1, "decode": 3}) == 8.0
    costs = NodeCosts.parse("prefill=2.5, decode=1.5")
    assert costs.per_hour({"prefill": 2, "decode": 1}) == 6.5
    with pytest.raises(ValueError, match="no cost given"):
        costs.per_hour({"mixed": 1})
    assert costs.per_hour({"mixed": 0, "decode": 2}) == 3.0  # a role with no workers is free


@pytest.mark.parametrize("bad", ["-1", "gpu=2", "prefill=x", "prefill=-2", "cheap"])
def test_bad_prices_name_the_flag(bad: str) -> None:
    with pytest.raises(ValueError, match="node_cost_per_hour"):
        NodeCosts.parse(bad)


def test_cost_per_million_tokens() -> None:
    cost = ClusterCost({"prefill": 1, "decode": 1}, per_hour=3.6)
    # 100 tokens/s within the SLO = 360,000 per hour: 3.6 / 0.36 million = 10 per million
    assert cost.per_million_tokens(100.0) == pytest.approx(10.0)
    assert cost.per_million_tokens(0.0) is None


def test_the_report_prices_each_point() -> None:
    empty = summarize([], Slo(1000.0, 0.0, 100.0, 0.9))
    priced = replace(empty, goodput_token_throughput=100.0)
    points = [
        PointResult("rate=1", "poisson", 1.0, None, "", priced, []),
        PointResult("rate=9", "poisson", 9.0, None, "", empty, []),
    ]
    lines = cost_lines(ClusterCost({"prefill": 1, "decode": 2}, per_hour=3.6), points)
    assert lines == [
        "Cost: 2 decode, 1 prefill worker(s) at 3.6 per hour (the gateway not counted).",
        "- rate=1: 10 per million output tokens at the SLO",
        "- rate=9: - (no output token within the SLO) per million output tokens at the SLO",
    ]

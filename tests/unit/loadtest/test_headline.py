"""The headline's turn-taking and report, with the clusters' points stood in for.

`_Deployment.measure` is the one seam: the stand-in returns a point of a chosen
attainment and records who ran when, so the order, the stop rule and the written report
are checked without starting four workers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image

from engine.precision import DType
from loadtest.harness.bench import load_synth
from loadtest.harness.bench_report import PointResult
from loadtest.harness.metrics import RequestRecord, Slo, summarize
from loadtest.harness.request_spec import BenchRequest
from loadtest.harness.runner import Pace
from loadtest.harness.settings import RunSettings
from loadtest.harness.traffic import TrafficConfig
from loadtest.headline.bench import SYSTEMS, _Deployment, _interleaved
from loadtest.headline.config import HeadlineConfig
from loadtest.headline.deployment import cluster_config
from loadtest.headline.report import HeadlineResults, SystemResult, markdown, write_outputs
from loadtest.reports.provenance import collect_provenance

# attainment of each deployment at each rate of the sweep below
ATTAINMENT = {
    "disaggregated": {0.2: 1.0, 0.3: 1.0, 0.4: 0.8, 0.5: 0.4},
    "colocated": {0.2: 1.0, 0.3: 0.3, 0.4: 1.0, 0.5: 1.0},
}


def _records(n: int, attainment: float, rate: float) -> list[RequestRecord]:
    """n requests, the first round(n * attainment) inside the SLO, the rest 1 s apart
    between tokens (an inter-token miss)."""
    good = round(n * attainment)
    return [
        RequestRecord(
            f"r{i}",
            "chat",
            sent_s=i / rate,
            first_token_s=i / rate + 0.3,
            finished_s=i / rate + 2.0,
            token_gaps_s=[0.08 if i < good else 1.0] * 10,
            prompt_tokens=200,
            cached_tokens=64,
            output_tokens=11,
        )
        for i in range(n)
    ]


class StandIn(_Deployment):
    def __init__(
        self,
        result: SystemResult,
        log: list[tuple[str, str]],
        capacity: dict[str, float] | None = None,
    ) -> None:
        super().__init__(result, "127.0.0.1:1")
        self.log = log
        self.capacity = capacity  # searched: attainment 1.0 up to this rate, 0.5 above

    async def measure(
        self, label: str, requests: Sequence[BenchRequest], pace: Pace, slo: Slo
    ) -> PointResult:
        self.log.append((self.result.name, label))
        if self.capacity is not None:
            chat = label.startswith("chat ")
            limit = self.capacity[self.result.name] * (4 if chat else 1)  # chat is lighter
            attained = 1.0 if pace.rate <= limit else 0.5
        else:
            attained = ATTAINMENT[self.result.name].get(pace.rate, 1.0)
        records = _records(len(requests), attained, pace.rate)
        self.result.wall_s += 1.0
        return PointResult(
            label, "poisson", pace.rate, None, "2026-01-01T00:00:00+00:00",
            summarize(records, slo), records,
        )  # fmt: skip


@pytest.fixture()
def run(tmp_path: Path, model_dir: Path) -> tuple[HeadlineResults, list[tuple[str, str]]]:
    cfg = HeadlineConfig(
        rates="0.2,0.3,0.4,0.5", num_requests=10, short_num_requests=10, warmup_requests=0,
        out_dir=tmp_path, progress=False, chat_search=False,
    )  # fmt: skip
    return _run_stand_ins(cfg, model_dir, plots=True)


def _run_stand_ins(
    cfg: HeadlineConfig, model_dir: Path, capacity: dict[str, float] | None = None, *,
    plots: bool,
) -> tuple[HeadlineResults, list[tuple[str, str]]]:  # fmt: skip
    """The headline's driver over stand-ins; returns the results (capacities derived)
    and who ran which point, in order."""
    model = RunSettings(model=str(model_dir), model_cache_dir=model_dir.parent)
    mix = replace(TrafficConfig(), workload="long_mix")
    results = HeadlineResults("2026-01-01T00:00:00+00:00", cfg, mix, cfg.slo, host_cpus=2)
    results.systems = [SystemResult(n, cluster_config(n, cfg, model)) for n in cfg.system_list]
    log: list[tuple[str, str]] = []
    stand_ins = [StandIn(r, log, capacity) for r in results.systems]
    provenance = collect_provenance()
    asyncio.run(_interleaved(stand_ins, cfg, mix, load_synth(model), results, provenance))  # type: ignore[arg-type]
    write_outputs(results, provenance, plots=plots)
    return results, log


def test_deployments_take_turns_and_a_stopped_one_sits_out(
    run: tuple[HeadlineResults, list[tuple[str, str]]],
) -> None:
    results, log = run
    d, c = "disaggregated", "colocated"
    # Who goes first alternates by rate; colocated fell under 0.5 at 0.3 and sat out the
    # rest of the sweep, but still ran the chat-only point.
    assert log == [(d, "0.2"), (c, "0.2"), (c, "0.3"), (d, "0.3"), (d, "0.4"), (d, "0.5"),
                   (d, "chat 0.5"), (c, "chat 0.5")]  # fmt: skip
    disagg, coloc = results.systems
    assert [p.rate for p in coloc.points] == [0.2, 0.3]
    assert coloc.skipped_rates == [0.4, 0.5]
    assert disagg.skipped_rates == []  # it fell under 0.5 only at the last rate
    assert disagg.short_only is not None and coloc.short_only is not None
    assert disagg.wall_s == len(disagg.points) + 1


def test_a_searched_capacity_is_bracketed_for_each_deployment(
    tmp_path: Path, model_dir: Path
) -> None:
    """Without fixed rates each deployment's capacity is searched for: doubling from the
    start rate until attainment falls under the target, then two bisections; the two
    take turns every round and each probes its own rate, so neither capacity is a
    lower bound however fast the host."""
    cfg = HeadlineConfig(
        num_requests=10, short_num_requests=10, warmup_requests=0, out_dir=tmp_path,
        progress=False, start_rate=0.3,
    )  # fmt: skip
    capacity = {"disaggregated": 0.7, "colocated": 0.4}
    results, log = _run_stand_ins(cfg, model_dir, capacity, plots=False)
    d, c = "disaggregated", "colocated"
    assert log[:9] == [(d, "0.3"), (c, "0.3"), (c, "0.6"), (d, "0.6"), (d, "1.2"),
                       (c, "0.45"), (c, "0.375"), (d, "0.9"), (d, "0.75")]  # fmt: skip
    disagg, coloc = results.systems
    assert (disagg.capacity_rate, disagg.capacity_qualifier) == (0.6, "bracketed")
    assert (coloc.capacity_rate, coloc.capacity_qualifier) == (0.375, "bracketed")
    assert results.capacity_ratio == pytest.approx(0.6 / 0.375)
    # Then the chat-only search, from short_rate (0.5): capacities 2.8 and 1.6 here.
    chat = log[9:]
    assert chat[:2] == [(d, "chat 0.5"), (c, "chat 0.5")] and all(
        n.startswith("chat ") for _, n in chat
    )
    assert (disagg.chat_capacity_rate, disagg.chat_capacity_qualifier) == (2.5, "bracketed")
    assert (coloc.chat_capacity_rate, coloc.chat_capacity_qualifier) == (1.5, "bracketed")
    assert results.chat_capacity_ratio == pytest.approx(2.5 / 1.5)
    assert disagg.short_only is disagg.chat_points[0]  # the point at short_rate
    md = (tmp_path / "headline.md").read_text()
    assert "Short prompts only, capacity by search:" in md and "**1.67x**" in md
    assert disagg.cluster.local_prefill_max_tokens == 512
    assert coloc.cluster.local_prefill_max_tokens is None
    assert disagg.cluster.dtype is coloc.cluster.dtype is None  # the workers' default


def test_a_dtype_reaches_both_deployments_workers(model_dir: Path) -> None:
    cfg = HeadlineConfig(dtype=DType.FLOAT32)
    model = RunSettings(model=str(model_dir), model_cache_dir=model_dir.parent)
    assert [cluster_config(n, cfg, model).dtype for n in SYSTEMS] == [DType.FLOAT32] * 2
    results = HeadlineResults("2026-01-01T00:00:00+00:00", cfg, TrafficConfig(), cfg.slo, 2)
    assert "compute dtype float32;" in markdown(results)


def test_report_carries_capacities_ratio_and_plots(
    run: tuple[HeadlineResults, list[tuple[str, str]]], tmp_path: Path
) -> None:
    results, _ = run
    data = json.loads((tmp_path / "headline.json").read_text())
    assert data["schema"] == "pdserve.headline/1" and data["provenance"]["taken_at"]
    disagg, coloc = data["systems"]
    # disaggregated holds 0.9 through 0.3 and drops to 0.8 at 0.4: crossing at 0.35;
    # colocated holds at 0.2 and drops to 0.3 at 0.3: crossing at 0.2 + 0.1 * (0.1 / 0.7).
    assert disagg["capacity_rate"] == pytest.approx(0.35)
    assert coloc["capacity_rate"] == pytest.approx(0.2 + 0.1 / 7)
    assert data["capacity_ratio"] == pytest.approx(0.35 / (0.2 + 0.1 / 7))
    md = (tmp_path / "headline.md").read_text()
    assert "disaggregated: 0.350 req/s" in md and "(target >= 1.5x: met)" in md
    assert len(results.plots) == 4
    for file in results.plots.values():
        with Image.open(tmp_path / file) as img:
            assert img.size[0] > 100 and img.size[1] > 100


def test_a_third_deployment_runs_in_turn_and_gets_its_ratio(
    tmp_path: Path, model_dir: Path
) -> None:
    """`--systems elastic,static,colocated`: three deployments take turns (the order
    reverses every round), the first's capacity is held against colocated for the
    target and against static too (the cost of the flexibility), and the static one
    runs with fixed roles in both its gateway and its workers."""
    cfg = HeadlineConfig(
        systems="elastic,static,colocated", num_requests=10, short_num_requests=10,
        warmup_requests=0, out_dir=tmp_path, progress=False, start_rate=0.3,
        chat_search=False,
    )  # fmt: skip
    capacity = {"elastic": 0.7, "static": 0.7, "colocated": 0.4}
    results, log = _run_stand_ins(cfg, model_dir, capacity, plots=False)
    assert log[:6] == [("elastic", "0.3"), ("static", "0.3"), ("colocated", "0.3"),
                       ("colocated", "0.6"), ("static", "0.6"), ("elastic", "0.6")]  # fmt: skip
    elastic, static, colocated = results.systems
    assert results.capacity_ratio == pytest.approx(0.6 / 0.375)
    assert results.capacity_ratios == {
        "static": pytest.approx(1.0), "colocated": pytest.approx(0.6 / 0.375)
    }  # fmt: skip
    assert static.cluster.gateway_args == "--elastic-roles false"
    assert static.cluster.worker_args == "--role-window-s 0"
    assert elastic.cluster.gateway_args == elastic.cluster.worker_args == ""
    assert (colocated.cluster.num_prefill, colocated.cluster.num_decode) == (0, 2)
    md = (tmp_path / "headline.md").read_text()
    assert md.startswith(
        "# Headline: elastic (1P+1D, elastic roles) vs static (1P+1D, fixed roles) vs "
        "colocated (2 mixed)"
    )
    assert "- ratio elastic / colocated: **1.60x** (target >= 1.5x: met)" in md
    assert "- ratio elastic / static: 1.00x" in md
    assert "| rate req/s | elastic goodput | attainment | static goodput |" in md


def test_systems_must_be_two_or_more_known_distinct_deployments() -> None:
    assert HeadlineConfig().system_list == ("disaggregated", "colocated")
    for bad in ("elastic", "elastic,elastic", "elastic,mixed", ""):
        with pytest.raises(ValueError, match="systems"):
            HeadlineConfig(systems=bad)

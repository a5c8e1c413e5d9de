"""The shifting-workload benchmark without a cluster: its phase schedule, the split of a
run's records into phases, the ratios and target, the report, and the driver's turns
over stand-in deployments (`Deployment.run` is the one seam)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from loadtest.harness.bench_main import Progress
from loadtest.harness.metrics import RequestRecord, RunMetrics, Slo, summarize
from loadtest.harness.request_spec import BenchRequest
from loadtest.harness.runner import Pace
from loadtest.harness.settings import RunSettings
from loadtest.harness.traffic import TrafficConfig
from loadtest.headline.deployment import Deployment, cluster_config
from loadtest.headline.phases import (
    Phase,
    arrival_times,
    parse_phases,
    schedule_requests,
    split_by_phase,
)
from loadtest.headline.shifting import _Bench, _run
from loadtest.headline.shifting_config import ShiftingConfig, unloaded_step_ms
from loadtest.headline.shifting_report import markdown
from loadtest.headline.shifting_results import (
    BEST,
    ShiftingResults,
    ShiftRun,
    SystemShift,
    derive,
    pair_ratio,
)
from loadtest.reports.provenance import collect_provenance
from loadtest.workloads.prompt_text import TextSynth

WORDS = [f" w{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}x" for i in range(200)]
SLO = Slo(2000.0, 12.0, 250.0, 0.9)
MODEL = RunSettings(model="/nonexistent/model")  # cluster configs only: nothing starts


def _record(rid: str, at: float, good: bool = True, kind: str = "chat") -> RequestRecord:
    """A request sent at `at`: inside the SLO, or 1 s between tokens (an ITL miss)."""
    return RequestRecord(
        rid, kind, sent_s=at, first_token_s=at + 0.3, finished_s=at + 2.0,
        token_gaps_s=[0.05 if good else 1.0] * 10, prompt_tokens=200, output_tokens=11,
    )  # fmt: skip


def test_phases_lie_end_to_end_and_bad_text_is_refused() -> None:
    chat, long, again = parse_phases("0:0.5:120, 0.5:0.15:60,0:0.5:120")
    assert (chat.start_s, chat.end_s, long.start_s, long.end_s) == (0, 120, 120, 180)
    assert (again.start_s, again.end_s, again.rate) == (180, 300, 0.5)
    assert (chat.name, long.name, long.duration_s) == ("chat", "50% long", 60)
    for bad in ("", "0:0.5", "1.5:1:10", "0:0:10", "0:1:0", "a:b:c"):
        with pytest.raises(ValueError, match="phases"):
            parse_phases(bad)


def test_arrivals_are_poisson_within_their_phase_and_reproducible() -> None:
    phase = Phase(0.0, 2.0, 100.0, 600.0)
    times = arrival_times(phase, 2.0, random.Random("a"))
    assert times == sorted(times) and times[0] > 100.0 and times[-1] < 600.0
    assert 900 < len(times) < 1100  # 1,000 expected; a 3-sigma band is about +-95
    assert arrival_times(phase, 2.0, random.Random("a")) == times
    assert arrival_times(phase, 4.0, random.Random("a")) != times


def test_a_schedule_is_stamped_by_phase_and_split_back() -> None:
    phases = parse_phases("0:2:10,0.5:1:10,0:2:10")
    traffic = TrafficConfig(long_prompt_tokens="20-40", system_tokens="8-16")
    scheduled = schedule_requests(phases, 1.0, traffic, TextSynth(WORDS), stream=500)
    reqs = scheduled.requests
    at = [r.at_s for r in reqs]
    assert all(a is not None for a in at) and at == sorted(at)  # type: ignore[type-var]
    assert len({r.request_id for r in reqs}) == len(reqs) == len(scheduled.phase_of)
    by_phase = [[r for r in reqs if scheduled.phase_of[r.request_id] == k] for k in range(3)]
    for k, phase in enumerate(phases):
        assert all(phase.start_s <= (r.at_s or 0) < phase.end_s for r in by_phase[k])
    assert {r.kind for r in by_phase[0] + by_phase[2]} == {"chat"}
    longs = sum(r.kind == "long" for r in by_phase[1])
    assert longs == len(by_phase[1]) // 2  # spread evenly: exactly half, rounded down
    # Deterministic, so every deployment of a round gets this very sequence; another
    # stream (the next point) draws another.
    assert schedule_requests(phases, 1.0, traffic, TextSynth(WORDS), stream=500) == scheduled
    other = schedule_requests(phases, 1.0, traffic, TextSynth(WORDS), stream=600)
    assert not {r.request_id for r in other.requests} & set(scheduled.phase_of)
    # A request counts in the phase it was sent in, however late it finished.
    records = [_record(r.request_id, 0.0) for r in reqs]
    split = split_by_phase(records, scheduled.phase_of, 3)
    assert [[r.request_id for r in p] for p in split] == [
        [r.request_id for r in p] for p in by_phase
    ]
    with pytest.raises(ValueError, match="no phase"):
        split_by_phase([_record("stray", 0.0)], scheduled.phase_of, 3)


def _metrics(goodput: float, attainment: float = 1.0) -> RunMetrics:
    return replace(summarize([_record("x", 0.0)], SLO), goodput=goodput, slo_attainment=attainment)


def _run_of(rnd: int, goodputs: Sequence[float], scale: float = 1.0) -> ShiftRun:
    """A run whose whole goodput is the first value, its phases' the rest."""
    whole, *phases = goodputs
    return ShiftRun(scale, rnd, 0, "", _metrics(whole), [_metrics(g) for g in phases], [])


def test_the_ratio_is_against_the_better_other_in_each_round_then_the_median() -> None:
    first = [_run_of(0, [1.2, 1.0, 0.2]), _run_of(1, [1.0, 1.0, 0.2]), _run_of(2, [0.9, 0.9, 0.3])]
    static = [_run_of(0, [0.4, 0.2, 0.2]), _run_of(1, [0.5, 0.3, 0.2])]  # no round 2
    colocated = [_run_of(0, [1.0, 1.0, 0.1]), _run_of(1, [0.8, 1.0, 0.05]), _run_of(2, [1, 1, 1])]
    best = pair_ratio(1.0, BEST, first, [static, colocated])
    # Only rounds 0 and 1 ran on all three: 1.2 / 1.0 and 1.0 / 0.8.
    assert best.rounds == [pytest.approx(1.2), pytest.approx(1.25)]
    assert best.whole == pytest.approx(1.225)
    # Per phase, the better other of each round: phase 1 colocated, phase 2 static.
    assert best.phases == [pytest.approx(1.0), pytest.approx(1.0)]
    alone = pair_ratio(1.0, "colocated", first, [colocated])
    assert alone.rounds == [pytest.approx(1.2), pytest.approx(1.25), pytest.approx(0.9)]
    assert alone.whole == pytest.approx(1.2) and alone.phases[1] == pytest.approx(2.0)
    zero = pair_ratio(1.0, "static", [_run_of(0, [1.0])], [[_run_of(0, [0.0])]])
    assert zero.whole is None  # over nothing: undefined, not infinite


def _results(tmp_path: Path, **overrides: object) -> ShiftingResults:
    cfg = ShiftingConfig(out_dir=tmp_path, itl_slo_ms=250.0, **overrides)  # type: ignore[arg-type]
    results = ShiftingResults("2026-01-01T00:00:00+00:00", cfg, TrafficConfig(),
                              cfg.phase_list, 2, slo=SLO)  # fmt: skip
    results.systems = [SystemShift(n, cluster_config(n, cfg, MODEL)) for n in cfg.system_list]
    return results


def test_one_scale_is_judged_by_goodput_a_sweep_by_capacity(tmp_path: Path) -> None:
    results = _results(tmp_path)
    elastic, static, colocated = results.systems
    elastic.runs = [_run_of(0, [1.4, 1, 1, 1]), _run_of(1, [1.1, 1, 1, 1])]
    static.runs = [_run_of(0, [0.5, 1, 1, 1]), _run_of(1, [0.5, 1, 1, 1])]
    colocated.runs = [_run_of(0, [1.0, 1, 1, 1]), _run_of(1, [1.0, 1, 1, 1])]
    derive(results)
    assert results.ratio == pytest.approx(1.25) and results.target_met is True
    assert results.targets[0].name == "shifting workload elastic / better of static and colocated"
    assert [p.other for p in results.ratios] == ["static", "colocated", BEST]
    elastic.runs[1] = _run_of(1, [0.9, 1, 1, 1])
    derive(results)
    assert results.ratio == pytest.approx(1.15) and results.target_met is False

    sweep = _results(tmp_path, rate_scales="1,2", rounds=1)
    for system, held in zip(sweep.systems, (1.0, 0.2, 0.5), strict=True):
        for scale in (1.0, 2.0):  # attainment 1 at scale 1, `held` at scale 2
            run = _run_of(0, [1, 1, 1, 1], scale)
            run.whole = _metrics(1.0, 1.0 if scale == 1 else held)
            system.runs.append(run)
    derive(sweep)
    assert [(s.capacity_scale, s.capacity_qualifier) for s in sweep.systems] == [
        (2.0, "at_least"), (pytest.approx(1 + 0.1 / 0.8), "interpolated"),
        (pytest.approx(1 + 0.1 / 0.5), "interpolated"),
    ]  # fmt: skip
    assert sweep.ratio == sweep.capacity_ratio == pytest.approx(2.0 / 1.2)
    assert sweep.ratio_basis.startswith("capacity (rate scale)")


def test_the_itl_slo_is_derived_from_the_unloaded_decode_step() -> None:
    warm = [_record("a", 0.0), replace(_record("b", 0.0), token_gaps_s=[0.1, 0.2, 0.3])]
    assert unloaded_step_ms(warm) == pytest.approx(50.0)  # the median of 13 gaps
    assert unloaded_step_ms([]) is None
    cfg = ShiftingConfig()
    assert cfg.derives_itl_slo and cfg.slo(140.3).itl_ms == 421.0  # 3 steps, whole ms
    assert ShiftingConfig(itl_slo_ms=300.0).slo(None).itl_ms == 300.0
    with pytest.raises(ValueError, match="decode step"):
        cfg.slo(None)
    with pytest.raises(ValueError, match="warmup_requests"):
        ShiftingConfig(warmup_requests=0)


#: Which phases each stand-in serves within the SLO (all its requests there, or none).
SERVES = {"elastic": (True, True, True), "static": (False, True, False),
          "colocated": (True, False, True)}  # fmt: skip


class StandIn(Deployment[SystemShift]):
    def __init__(self, result: SystemShift, log: list[str], phases: list[Phase]) -> None:
        super().__init__(result, "127.0.0.1:1")
        self.log, self.phases = log, phases

    async def run(self, requests: Sequence[BenchRequest], pace: Pace) -> list[RequestRecord]:
        self.log.append(self.result.name)
        assert pace.duration_s == self.phases[-1].end_s
        out = []
        for req in requests:
            at = req.at_s or 0.0
            k = next(i for i, p in enumerate(self.phases) if p.start_s <= at < p.end_s)
            out.append(_record(req.request_id, at, SERVES[self.result.name][k], req.kind))
        self.result.wall_s += 1.0
        return out


def test_the_driver_takes_turns_and_reports_each_phase(tmp_path: Path) -> None:
    results = _results(tmp_path, phases="0:1:30,0.5:1:30,0:1:30", warmup_requests=0,
                       progress=False)  # fmt: skip
    results.slo = None  # the driver sets it (given here: no warm-up to derive from)
    log: list[str] = []
    deployments = [StandIn(s, log, results.phases) for s in results.systems]
    traffic = TrafficConfig(long_prompt_tokens="20-40", system_tokens="8-16")
    bench = _Bench(results.config, traffic, TextSynth(WORDS), results, collect_provenance(),
                   Progress("test"))  # fmt: skip
    asyncio.run(_run(deployments, bench))  # type: ignore[arg-type]
    assert log == ["elastic", "static", "colocated", "colocated", "static", "elastic"]
    assert results.slo is not None and results.slo.itl_ms == 250.0
    _, static, colocated = results.systems
    assert [r.position for r in static.runs] == [1, 1]
    assert [r.position for r in colocated.runs] == [2, 0]
    assert [q.attainment for q in static.scales[0].phases] == [0.0, 1.0, 0.0]
    assert [q.attainment for q in colocated.scales[0].phases] == [1.0, 0.0, 1.0]
    # Both rounds sent the same requests to every deployment (round by round).
    for rnd in (0, 1):
        ids = [[r.request_id for r in s.runs[rnd].requests] for s in results.systems]
        assert ids[0] == ids[1] == ids[2]
    best = next(p for p in results.ratios if p.other == BEST)
    assert best.phases[1] == pytest.approx(1.0)  # static serves the long phase too
    assert results.ratio is not None and results.ratio > 1.0
    data = json.loads((tmp_path / "shifting.json").read_text())
    assert data["schema"] == "pdserve.shifting/1" and data["provenance"]["taken_at"]
    assert data["targets"][0]["threshold"] == 1.2
    assert len(data["systems"][0]["runs"][0]["phases"]) == 3
    md = (tmp_path / "shifting.md").read_text()
    assert md == markdown(results)
    verdict = "met" if results.target_met else "NOT met"
    assert f"**{results.ratio:.2f}x**: goodput over the whole schedule" in md
    assert f"(target >= 1.2x: {verdict})" in md
    assert "| 2 50% long | colocated | 2 |" in md and "| 2 50% long | static | 2 |" in md
    assert "- cost of the flexibility on the long-prompt phases at scale 1: goodput " in md
    assert "| 1 | 2 | 1 | colocated |" in md  # scale 1, round 2: colocated went first

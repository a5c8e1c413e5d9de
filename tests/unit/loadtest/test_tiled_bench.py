"""The tiled benchmark's report: targets from its phases and its invariance check, and
the section docs/benchmarks.md renders from them (no engine is run here)."""

from __future__ import annotations

from dataclasses import asdict

from loadtest.engine.tiled_bench import (
    Invariance,
    PhaseSpeed,
    TiledBenchConfig,
    TiledBenchReport,
    targets,
)
from loadtest.reports.engine_sections import tiled
from loadtest.reports.result_file import jsonable


def _report() -> TiledBenchReport:
    report = TiledBenchReport("pdserve.tiled_bench/1", TiledBenchConfig(rounds=2))
    report.phases = [
        PhaseSpeed(1, 3, 90, [10.0, 11.0], [10.5, 11.0], 1.025, 1.0, True),
        PhaseSpeed(32, 32, 900, [50.0, 52.0], [40.0, 44.0], 0.82, 0.846, False),
    ]
    report.invariance = [Invariance("off", 64, False, 20), Invariance("on", 64, True, 0)]
    report.targets = targets(report)
    return report


def test_targets_hold_each_batch_to_the_floor_and_on_to_no_differing_logprob() -> None:
    got = {t.name: (t.measured, t.met) for t in _report().targets}
    assert got == {
        "invariant / off throughput, batch 1": (1.025, True),
        "invariant / off throughput, batch 32": (0.82, False),
        "invariant: log-probabilities that differ alone vs batched": (0, True),
    }


def test_the_section_shows_medians_each_round_and_both_sides() -> None:
    data = jsonable(asdict(_report()))
    assert isinstance(data, dict)
    text = "\n".join(tiled(data))
    assert "| 32 | 32 | 51.0 | 42.0 | 40.0, 44.0 | 0.82x | 0.85x |" in text
    assert "| on | 64 | 0 |" in text and "| off | 64 | 20 |" in text

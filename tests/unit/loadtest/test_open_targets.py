"""Open targets on docs/benchmarks.md: every target a current result misses is listed
with the issue holding it open, `--check` fails on one no issue holds and on an entry
whose target is met; a stale result's targets are neither listed nor checked; the
committed registry names targets the committed results state."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.reports.markdown import Json, targets_of
from loadtest.reports.open_targets import OPEN, OpenTarget, by_key, open_table, problems
from loadtest.reports.results import load, result_paths

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"


def _target(name: str, measured: float, threshold: float, met: bool) -> Json:
    return {"name": name, "measured": measured, "threshold": threshold,
            "comparison": ">=", "met": met, "context": ""}  # fmt: skip


def _loaded() -> list[tuple[Path, Json]]:
    """`lora` misses one target and meets another; `spec` misses one."""
    lora = {"targets": [_target("r16", 0.79, 0.8, False), _target("r8", 0.92, 0.8, True)]}
    spec = {"targets": [_target("repetitive", 1.01, 1.8, False)]}
    return [(Path("lora.json"), lora), (Path("spec.json"), spec)]


def test_a_missed_target_needs_an_issue() -> None:
    entries = [OpenTarget("lora", "r16", 43)]
    found = problems(_loaded(), {}, entries)
    assert found == [
        "spec: target 'repetitive' is not met and no issue holds it open: "
        "add it to OPEN in loadtest/reports/open_targets.py"
    ]
    assert problems(_loaded(), {}, [*entries, OpenTarget("spec", "repetitive", 42)]) == []


def test_an_entry_for_a_met_or_unstated_target_must_go() -> None:
    entries = [
        OpenTarget("lora", "r16", 43),
        OpenTarget("spec", "repetitive", 42),
        OpenTarget("lora", "r8", 43),
        OpenTarget("spec", "chat", 42),
    ]
    assert problems(_loaded(), {}, entries) == [
        "lora: 'r8' is met now: delete its entry from OPEN",
        "spec: OPEN names 'chat', which the result does not state",
    ]


def test_a_stale_result_is_neither_listed_nor_checked() -> None:
    stale = {"spec": ("registered",)}
    assert problems(_loaded(), stale, [OpenTarget("lora", "r16", 43)]) == []
    rows = open_table(_loaded(), stale, [OpenTarget("lora", "r16", 43)])
    assert rows[0] == "## Open targets"
    assert "| lora | r16 | 0.790 | >= 0.8 | #43 |" in rows
    assert not any("repetitive" in row for row in rows)


def test_the_table_names_an_unheld_miss_and_is_empty_when_all_are_met() -> None:
    rows = open_table(_loaded(), {}, [OpenTarget("lora", "r16", 43)])
    assert "| spec | repetitive | 1.010 | >= 1.8 | **none** |" in rows
    met = [(Path("lora.json"), {"targets": [_target("r8", 0.92, 0.8, True)]})]
    assert open_table(met, {}, []) == []


def test_the_engine_benchmark_verdicts_in_its_phases_are_targets() -> None:
    phase = {
        "batch_size": 32, "ratio": 8.3, "target": 3.0, "met": True, "cb_ratio": 4.2,
        "cb_met": True, "dtype_ratio": 1.98, "dtype_target": 2.5, "dtype_met": False,
    }  # fmt: skip
    data = {"schema": "pdserve.engine_bench/2", "phases": [phase, {"batch_size": 8}]}
    names = [(t["name"], t["met"]) for t in targets_of(data)]
    assert names == [
        ("batch 32: pdserve / transformers tok/s", True),
        ("batch 32: pdserve / transformers CB tok/s", True),
        ("batch 32: pdserve / pdserve float32 tok/s", False),
    ]
    # Another schema's phases are not read as verdicts.
    assert targets_of({"schema": "pdserve.shifting/1", "phases": [phase]}) == []


def test_an_entry_names_a_result_a_target_and_an_issue_once() -> None:
    for bad in (("lora.json", "r16", 43), ("lora", " ", 43), ("lora", "r16", 0)):
        with pytest.raises(ValueError):
            OpenTarget(*bad)
    with pytest.raises(ValueError, match="twice"):
        by_key([OpenTarget("lora", "r16", 43), OpenTarget("lora", "r16", 41)])


def test_the_registry_names_targets_the_committed_results_state() -> None:
    stated = {
        (path.stem, str(t.get("name"))) for path, data in load(RESULTS) for t in targets_of(data)
    }
    assert {path.stem for path in result_paths(RESULTS)} >= {e.result for e in OPEN}
    assert set(by_key()) <= stated

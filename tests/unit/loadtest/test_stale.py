"""Stale results on docs/benchmarks.md: a registered result is marked with its commit and
reason, its targets read "not current" and the page's count of met targets leaves it
out; the committed registry names committed results."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from loadtest.harness.target import TargetResult
from loadtest.reports.provenance import Host, Provenance
from loadtest.reports.result_file import write_result
from loadtest.reports.results import render, result_paths
from loadtest.reports.stale import STALE, StaleResult, by_result
from tests.unit.loadtest.measured_tree import SOURCES, measured_tree

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"
PROVENANCE = Provenance(
    commit="cd" * 20,
    dirty=False,
    taken_at="2026-01-02T03:04:05+00:00",
    command="python -m loadtest.engine.spec_bench --out docs/results/spec.json",
    host=Host("bench-host", "Example CPU @ 2.0GHz", 2, 2, "3.11.9", "Linux"),
    sources=SOURCES,
)
OLD = StaleResult("spec", "ab" * 20, "measured before the fast kernel; re-run: 1.01x")


@dataclass(frozen=True)
class SpecLike:
    schema: str = "pdserve.spec_bench/1"
    targets: list[TargetResult] = field(default_factory=list)


def _write(results: Path) -> None:
    """Two results whose every target is met: `spec` (registered stale) and `fresh`."""
    met = [TargetResult.check("spec / off", 1.9, ">=", 1.8)]
    write_result(results / "spec.json", SpecLike(targets=met), PROVENANCE)
    both = [*met, TargetResult.check("chat", 1.2, ">=", 0.95)]
    write_result(results / "fresh.json", SpecLike("pdserve.fresh/1", both), PROVENANCE)


def _section(page: str, title: str) -> str:
    start = page.index(f"## {title}\n")
    end = page.find("\n## ", start + 1)
    return page[start : end if end >= 0 else len(page)]


def test_a_stale_result_is_marked_and_not_counted_as_met(tmp_path: Path) -> None:
    _write(tmp_path)
    page = render(tmp_path, tmp_path.parent, {"spec": OLD}, measured_tree(tmp_path / "src"))
    spec = _section(page, "Speculative decoding")
    assert "Stale since `abababababab`: measured before the fast kernel; re-run: 1.01x." in spec
    assert "| spec / off | 1.900 | >= 1.8 | not current |" in spec
    assert "| met |" not in spec
    fresh = _section(page, "`pdserve.fresh/1`")
    assert "Stale since" not in fresh and fresh.count("| met |") == 2
    # Three targets met in the files; the stale one's is not counted.
    assert "Targets met in the current results: 2 of 2." in page
    assert "their targets are not counted): spec." in page


def test_without_the_entry_the_same_result_is_current(tmp_path: Path) -> None:
    _write(tmp_path)
    page = render(tmp_path, tmp_path.parent, {}, measured_tree(tmp_path / "src"))
    assert "Stale since" not in page and "| not current |" not in page
    assert "Targets met in the current results: 3 of 3." in page
    assert "| spec / off | 1.900 | >= 1.8 | met |" in _section(page, "Speculative decoding")


def test_the_registry_names_committed_results_once() -> None:
    registered = by_result()
    assert len(registered) == len(STALE)
    quoted = {path.stem for path in result_paths(RESULTS)}  # the top and EXTRA_RESULTS
    for name, entry in registered.items():
        assert name in quoted, name
        assert entry.line.startswith(f"Stale since `{entry.since[:12]}`: ")
    with pytest.raises(ValueError, match="twice"):
        by_result([OLD, OLD])


@pytest.mark.parametrize(
    ("result", "since", "reason"),
    [("spec.json", "ab" * 20, "r"), ("spec", "abababababab", "r"), ("spec", "ab" * 20, " ")],
)
def test_an_entry_needs_a_stem_a_full_commit_and_a_reason(
    result: str, since: str, reason: str
) -> None:
    with pytest.raises(ValueError):
        StaleResult(result, since, reason)

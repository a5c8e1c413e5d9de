"""docs/benchmarks.md from committed result files: provenance on every section, the
schemas' tables, refusal of a file without provenance, and an idempotent page."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from loadtest.harness.target import TargetResult
from loadtest.reports.provenance import Host, Provenance
from loadtest.reports.result_file import read_result, write_result
from loadtest.reports.results import main, render

PROVENANCE = Provenance(
    commit="ab" * 20,
    dirty=False,
    taken_at="2026-01-02T03:04:05+00:00",
    command="python -m loadtest.overhead.gateway_bench --out docs/results/gateway.json",
    host=Host("bench-host", "Example CPU @ 2.0GHz", 2, 2, "3.11.9", "Linux"),
)


@dataclass(frozen=True)
class GatewayLike:
    schema: str
    gateway_ttft_p50_ms: float
    direct_prefill_p50_ms: float
    overhead_p50_ms: float
    overhead_paired_p50_ms: float
    target_ms: float
    met: bool
    reps: int


@dataclass(frozen=True)
class Unknown:
    schema: str
    speedup: float
    targets: list[TargetResult]


def _write(results: Path) -> None:
    gateway = GatewayLike("pdserve.gateway_bench/1", 101.5, 100.0, 1.5, 1.25, 3.0, True, 300)
    write_result(results / "gateway.json", gateway, PROVENANCE)
    target = TargetResult.check("speedup", 1.7, ">=", 1.5)
    write_result(results / "a_new.json", Unknown("pdserve.new/1", 1.7, [target]), PROVENANCE)


def test_page_quotes_each_file_with_its_provenance(tmp_path: Path) -> None:
    _write(tmp_path)
    page = render(tmp_path, tmp_path.parent)
    assert page.index("## Gateway overhead") < page.index("## `pdserve.new/1`")
    assert page.count("Taken 2026-01-02T03:04:05+00:00 on commit `abababababab`") == 2
    assert "host bench-host (Example CPU @ 2.0GHz; 2 of 2 CPUs usable)" in page
    link = f"{tmp_path.name}/gateway.json"
    assert f"File [{link}]({link})" in page
    assert "`python -m loadtest.overhead.gateway_bench --out docs/results/gateway.json`" in page
    assert "| 101.50 | 100.00 | 1.50 | 1.25 | <= 3 | 300 |" in page
    assert "| `speedup` | 1.7 |" in page  # a schema without a renderer: its numbers


def test_a_file_without_provenance_is_refused(tmp_path: Path) -> None:
    (tmp_path / "old.json").write_text(json.dumps({"schema": "pdserve.bench/1", "points": []}))
    with pytest.raises(ValueError, match=r"old\.json: no provenance"):
        read_result(tmp_path / "old.json")
    md = tmp_path / "out.md"
    assert main(["--results-dir", str(tmp_path), "--markdown", str(md)]) == 2
    assert not md.exists()


def test_write_is_idempotent_and_check_tells_stale(tmp_path: Path) -> None:
    results, md = tmp_path / "results", tmp_path / "benchmarks.md"
    results.mkdir()
    argv = ["--results-dir", str(results), "--markdown", str(md)]
    assert main([*argv, "--check", "true"]) == 1  # no page yet
    assert main(argv) == 0
    assert "No results committed yet" in md.read_text()
    _write(results)
    assert main([*argv, "--check", "true"]) == 1
    assert main(argv) == 0
    first = md.read_text()
    assert main(argv) == 0 and md.read_text() == first
    assert main([*argv, "--check", "true"]) == 0

"""The bench's JSON, markdown and plots from hand-made records (no cluster)."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from loadtest.harness.bench import plot_points
from loadtest.harness.bench_config import BenchConfig
from loadtest.harness.bench_report import BenchResults, PointResult, write_markdown
from loadtest.harness.metrics import RequestRecord, summarize
from loadtest.harness.traffic import TrafficConfig
from loadtest.reports.provenance import collect_provenance
from loadtest.reports.result_file import write_result


def _point(label: str, rate: float, n: int) -> PointResult:
    records = [
        RequestRecord(
            f"r{i}",
            "chat",
            sent_s=i / rate,
            first_token_s=i / rate + 0.3,
            finished_s=i / rate + 1.0,
            token_gaps_s=[0.07 * (1 + i % 3)] * 10,
            prompt_tokens=120,
            cached_tokens=64,
            output_tokens=11,
        )
        for i in range(n)
    ]
    records.append(
        RequestRecord(
            "bad",
            "long",
            sent_s=n / rate,
            code="RESOURCE_EXHAUSTED",
            finished_s=n / rate + 0.01,
            error="too many streams",
        )
    )
    cfg = BenchConfig()
    return PointResult(
        label,
        "poisson",
        rate,
        None,
        "2026-01-01T00:00:00+00:00",
        summarize(records, cfg.slo),
        records,
    )


def test_results_json_markdown_and_plots(tmp_path: Path) -> None:
    cfg = BenchConfig(out_dir=tmp_path)
    results = BenchResults("2026-01-01T00:00:00+00:00", cfg, TrafficConfig(), cfg.slo)
    results.points = [_point("rate=1", 1.0, 8), _point("rate=2", 2.0, 8)]
    results.plots = plot_points(tmp_path, results.points, cfg)
    write_result(tmp_path / "results.json", results, collect_provenance())
    md = write_markdown(tmp_path / "summary.md", results).read_text()

    data = json.loads((tmp_path / "results.json").read_text())
    assert data["schema"] == "pdserve.bench/1"
    assert list(data)[:2] == ["schema", "provenance"]
    assert data["bench"]["out_dir"] == str(tmp_path)
    first = data["points"][0]
    assert first["metrics"]["sent"] == 9 and first["metrics"]["errors_by_code"] == {
        "RESOURCE_EXHAUSTED": 1
    }
    # the failed request has no TTFT: its class's TTFT percentiles are NaN -> null
    assert first["metrics"]["by_kind"]["long"]["ttft_ms"]["p50"] is None
    assert len(first["requests"]) == 9
    assert "| rate=2 | 9 | 8 | 1 |" in md and "RESOURCE_EXHAUSTED 1" in md
    for name in ("ttft_cdf", "itl_cdf", "goodput_vs_rate", "attainment_vs_rate"):
        assert f"]({name}.png)" in md
        with Image.open(tmp_path / f"{name}.png") as img:
            assert img.format == "PNG" and img.size[0] > 300 and img.size[1] > 200

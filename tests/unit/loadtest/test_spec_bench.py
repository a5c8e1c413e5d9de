"""The speculative decoding benchmark on a tiny model: its workloads, the report's rows
and targets, and the results page section (the real run is `make bench`'s)."""

from __future__ import annotations

from pathlib import Path

from loadtest.engine import spec_bench
from loadtest.reports.provenance import collect_provenance
from loadtest.reports.result_file import read_result, write_result
from loadtest.reports.sections import section
from tests.tiny_models import write_tiny_model


def test_a_short_run_reports_every_workload_with_targets(tmp_path: Path) -> None:
    model = tmp_path / "llama3"
    write_tiny_model("llama3", model)
    report = spec_bench.measure(str(model), threads=1, reps=2, max_tokens=6)
    assert [w.workload for w in report.workloads] == ["repetitive", "chat", "open"]
    greedy, sampled = report.workloads[:2], report.workloads[2]
    for w in greedy:
        assert w.requests == 4 and w.tokens == 4 * 5  # the first token is prefill's
    # Sampled with EOS honoured after half the tokens: 2 to 5 decode tokens a request.
    assert sampled.requests == 8 and 8 * 2 <= sampled.tokens <= 8 * 5
    for w in report.workloads:
        assert w.off_tokens_per_s > 0 and w.spec_tokens_per_s > 0
        assert w.ratio == w.spec_tokens_per_s / w.off_tokens_per_s
        pairs = [s / o for s, o in zip(w.rounds_spec, w.rounds_off, strict=True)]
        assert len(pairs) == 2 and w.paired_ratio == sum(pairs) / 2  # median of two
        assert 0.0 <= w.acceptance_rate <= 1.0
    assert [t.threshold for t in report.targets] == [1.8, 0.95, 0.95]
    out = write_result(tmp_path / "spec.json", report, collect_provenance(["spec_bench"]))
    lines = section(read_result(out), "spec.json")
    assert lines[0] == "## Speculative decoding"
    assert any(line.startswith("| repetitive | 4 |") for line in lines)
    assert any(line.startswith("| open | 8 |") for line in lines)
    assert any("median of paired rounds" in line for line in lines)
    assert any("spec / off decode tokens/s" in line for line in lines)

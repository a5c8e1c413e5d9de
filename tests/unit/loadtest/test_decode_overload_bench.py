"""The decode-heavy overload benchmark and the flow benchmarks' ITL judgement, without a
cluster: token gaps on a record, the SLO with and without an ITL limit, the flags, the
targets and the terminal table."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest

from engine.priority import Priority
from loadtest.flow import decode_overload_bench as bench
from loadtest.flow.cluster import LeakCheck
from loadtest.flow.phase import summarize_phase
from loadtest.flow.record import FlowRecord
from loadtest.flow.refusal import Refusal
from loadtest.flow.traffic import FlowStream
from loadtest.harness.bench_main import parse_args
from loadtest.harness.capacity_search import Probe, Qualifier, SearchResult
from loadtest.harness.settings import RunSettings
from loadtest.harness.target import TargetResult
from loadtest.reliability.leak_probe import Leaks
from loadtest.reports.provenance import Host, Provenance
from loadtest.reports.result_file import read_result, write_result
from loadtest.reports.sections import section
from services.common.status import RefusalReason

CRIT, STD = Priority.CRITICAL, Priority.STANDARD
CLEAN = LeakCheck(True, [Leaks({}, {}, {}, {}, {}, {})])
PROVENANCE = Provenance("ab" * 20, False, "2026-01-02T03:04:05+00:00", "python -m x",
                        Host("h", "cpu", 2, 2, "3.11", "Linux"))  # fmt: skip


def _streamed(priority: Priority, gaps_s: list[float], ttft_s: float = 0.5) -> FlowRecord:
    """A served request whose tokens came `gaps_s` apart after its first."""
    rec = FlowRecord("r", f"tenant-{priority.label}", priority, 0, 0.0)
    at = ttft_s
    rec.took(at, 1)
    for gap in gaps_s:
        at += gap
        rec.took(at, 1)
    rec.finished_s, rec.prompt_tokens, rec.output_tokens = at, 64, len(gaps_s) + 1
    return rec


def test_a_record_keeps_its_token_gaps() -> None:
    rec = FlowRecord("r", "t", STD, 0, 0.0)
    rec.took(0.5, 1)
    rec.took(0.7, 2)  # two tokens in one message after 0.2 s: two gaps of 0.1 s
    rec.took(0.7, 0)  # a message without tokens (the last one) adds nothing
    assert rec.first_token_s == 0.5 and rec.streamed_tokens == 3
    assert rec.token_gaps_s == pytest.approx([0.1, 0.1])


def test_the_itl_slo_judges_a_requests_own_p90_gap() -> None:
    _, cfg = parse_args(bench.SPEC, ["--itl-slo-ms", "50"])
    slo = cfg.slo()
    smooth = _streamed(STD, [0.03] * 20)
    stalling = _streamed(STD, [0.03] * 17 + [0.2] * 3)  # 15% of its gaps are 200 ms
    assert slo.met(STD, True, smooth.ttft_s, smooth.itl_p90_s)
    assert not slo.met(STD, True, stalling.ttft_s, stalling.itl_p90_s)
    # Without an ITL SLO only the TTFT counts, as before.
    _, ttft_only = parse_args(bench.SPEC, [])
    assert ttft_only.slo().met(STD, True, stalling.ttft_s, stalling.itl_p90_s)


def test_flags_reach_the_gateway_and_bad_ones_are_refused() -> None:
    settings, cfg = parse_args(bench.SPEC, ["--itl-budget-s", "0.05"])
    assert settings.out.name == "decode_overload.json"
    assert (cfg.prompt_tokens, cfg.output_tokens) == (64, 192)
    assert shlex.split(cfg.gateway_args) == ["--itl-budget-s", "0.05"]
    for argv in (["--itl-slo-factor", "1"], ["--itl-budget-share", "0"], ["--itl-slo-ms", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bench.SPEC, argv)


def _deployment(cfg: bench.DecodeOverloadConfig, records: list[FlowRecord], budget: float,
                capacity_rps: float) -> bench.Deployment:  # fmt: skip
    streams = [FlowStream("tenant-critical", CRIT, 1.0), FlowStream("tenant-standard", STD, 1.0)]
    summary = summarize_phase("x", streams, 10.0, records, cfg.slo(), {})
    return bench.Deployment(budget, summary, bench.refusals_without_hint(records), CLEAN,
                            summary.goodput.requests_per_s / capacity_rps)  # fmt: skip


def _report(cfg: bench.DecodeOverloadConfig, off: bench.Deployment, on: bench.Deployment,
            targets: list[TargetResult]) -> bench.DecodeOverloadReport:  # fmt: skip
    """A report of a 0.2 req/s capacity (one probe) overloaded at 0.6 req/s."""
    probe = Probe(0.2, 20.0, 4, 4, 1.0, 0.2, 38.4)
    return bench.DecodeOverloadReport(
        bench.SCHEMA, RunSettings(), cfg, {"critical": 10.0}, 20.0, 60.0,
        SearchResult(0.2, Qualifier.BRACKETED, probe, [probe]), 0.6, 0.2, off, on,
        bench.critical_itl_p90_ms(on), bench.critical_itl_p90_ms(off), targets,
    )  # fmt: skip


def test_targets_and_table() -> None:
    cfg = bench.DecodeOverloadConfig(itl_slo_ms=60.0, duration_s=10)
    refused = FlowRecord("r", "tenant-standard", STD, 0, 0.0, code="UNAVAILABLE", finished_s=5.0)
    refused.refusal = Refusal(503, RefusalReason.BUDGET, retry_after_s=None)
    on = _deployment(cfg, [_streamed(CRIT, [0.04] * 30), _streamed(STD, [0.05] * 30), refused],
                     0.048, 0.2)  # fmt: skip
    off = _deployment(cfg, [_streamed(CRIT, [0.09] * 30), _streamed(STD, [0.09] * 30)], 0, 0.2)
    targets = bench.targets(cfg, on, 60.0)
    assert [t.met for t in targets] == [True, True, False, True]  # the refusal had no hint
    report = _report(cfg, off, on, targets)
    assert report.critical_itl_p90_ms == pytest.approx(40.0)
    assert report.critical_itl_p90_ms_baseline == pytest.approx(90.0)
    table = bench.format_table(report)
    assert "critical ITL p90: 40 ms with ITL admission, 90 ms without" in table
    assert "FAIL  refusals without a retry hint" in table


def test_the_docs_section_shows_both_deployments(tmp_path: Path) -> None:
    cfg = bench.DecodeOverloadConfig(itl_slo_ms=60.0, duration_s=10)
    on = _deployment(cfg, [_streamed(CRIT, [0.04] * 30)], 0.048, 0.2)
    off = _deployment(cfg, [_streamed(CRIT, [0.09] * 30)], 0, 0.2)
    report = _report(cfg, off, on, bench.targets(cfg, on, 60))
    path = write_result(tmp_path / "decode_overload.json", report, PROVENANCE)
    page = "\n".join(section(read_result(path), "decode_overload.json"))
    assert "## Decode-heavy overload: ITL admission on against off" in page
    assert "critical ITL p90 **40 ms** with ITL admission against 90 ms without" in page
    assert "| ITL admission off (0 s) | critical |" in page
    assert "| ITL admission on (0.048 s) | critical |" in page


def test_paired_rounds_give_the_median_ratio_and_show_each_round(tmp_path: Path) -> None:
    cfg = bench.DecodeOverloadConfig(itl_slo_ms=60.0, duration_s=10)
    # Goodput at capacity is the rate times its attainment, whatever the window held.
    rounds = [bench.PairedRound.of(0.2, 1.0, 0.19), bench.PairedRound.of(0.2, 1.0, 0.17),
              bench.PairedRound.of(0.25, 0.8, 0.2)]  # fmt: skip
    assert [r.capacity_goodput_rps for r in rounds] == pytest.approx([0.2, 0.2, 0.2])
    assert [r.ratio for r in rounds] == pytest.approx([0.95, 0.85, 1.0])
    on = dataclasses.replace(_deployment(cfg, [_streamed(CRIT, [0.04] * 30)], 0.048, 0.2),
                             goodput_ratio=0.95, rounds=rounds)  # fmt: skip
    off = _deployment(cfg, [_streamed(CRIT, [0.09] * 30)], 0, 0.2)
    targets = bench.targets(cfg, on, 60.0)
    assert targets[1].met and targets[1].context == (
        "median of 3 paired rounds; rounds from 0.85x to 1.00x"
    )
    report = _report(cfg, off, on, targets)
    assert "  round 2: goodput 0.200 req/s at capacity, 0.170 overloaded: 0.85x" in (
        bench.format_table(report)
    )
    path = write_result(tmp_path / "decode_overload.json", report, PROVENANCE)
    page = "\n".join(section(read_result(path), "decode_overload.json"))
    assert "**0.95x**, the median of 3 paired rounds" in page
    assert "0.190 / 0.200, 0.170 / 0.200, 0.200 / 0.200" in page


def test_rounds_must_be_positive() -> None:
    with pytest.raises(SystemExit):
        parse_args(bench.SPEC, ["--rounds", "0"])

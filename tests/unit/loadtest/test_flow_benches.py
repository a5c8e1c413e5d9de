"""The overload and noisy-neighbour benchmarks without a cluster: flags, the admission
flags passed only when set, the keys file, the phase plan, targets, the terminal tables
and the docs sections rendered from their JSON."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from engine.priority import Priority
from loadtest.flow import fairness_bench, overload_bench
from loadtest.flow.cluster import LeakCheck, Tenant, cluster_config, keys_file_text
from loadtest.flow.fairness_config import FairnessBenchConfig
from loadtest.flow.overload_config import OverloadBenchConfig, parse_mix
from loadtest.flow.phase import summarize_phase
from loadtest.flow.record import FlowRecord
from loadtest.flow.traffic import FlowStream
from loadtest.harness.bench_main import parse_args
from loadtest.harness.capacity_search import Probe, Qualifier, SearchResult
from loadtest.harness.settings import RunSettings
from loadtest.reliability.leak_probe import Leaks
from loadtest.reports.provenance import Host, Provenance
from loadtest.reports.result_file import read_result, write_result
from loadtest.reports.sections import section
from services.gateway.access.auth import ApiKeys

STD = Priority.STANDARD
PROVENANCE = Provenance("ab" * 20, False, "2026-01-02T03:04:05+00:00", "python -m x",
                        Host("h", "cpu", 2, 2, "3.11", "Linux"))  # fmt: skip
CLEAN = LeakCheck(True, [Leaks({}, {}, {}, {}, {}, {})])


def test_defaults_parse_and_admission_flags_pass_only_when_set() -> None:
    settings, cfg = parse_args(overload_bench.SPEC, [])
    assert settings.out == Path("bench-results/overload.json")
    assert cfg == OverloadBenchConfig() and cfg.gateway_args == ""
    _, cfg = parse_args(overload_bench.SPEC, [
        "--duration-s", "15", "--ttft-budget-standard-s", "4", "--admission-control", "false",
        "--waiting-room-size", "32"])  # fmt: skip
    assert shlex.split(cfg.gateway_args) == ["--ttft-budget-standard-s", "4.0",
                                             "--waiting-room-size", "32",
                                             "--admission-control", "false"]  # fmt: skip
    assert cfg.slo().budget_s(STD) == 4.0 and cfg.slo().budget_s(Priority.CRITICAL) == 10.0
    settings, fair = parse_args(fairness_bench.SPEC, ["--share-rate", "0.3", "--phase-s", "10"])
    assert settings.out == Path("bench-results/fairness.json")
    assert fair == FairnessBenchConfig(share_rate=0.3, phase_s=10.0)


@pytest.mark.parametrize(
    "argv",
    [["--class-mix", "1,2"], ["--class-mix", "0,0,0"], ["--overload-factor", "0.5"],
     ["--search-start-rate", "100"], ["--ttft-budget-critical-s", "-1"]],
)  # fmt: skip
def test_bad_flags_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(overload_bench.SPEC, argv)


def test_class_mix() -> None:
    assert parse_mix("2,5,3") == {Priority.CRITICAL: 0.2, STD: 0.5, Priority.SHEDDABLE: 0.3}
    assert parse_mix("0,1,0") == {STD: 1.0}


def test_keys_file_is_what_the_gateway_reads(tmp_path: Path) -> None:
    tenants = list(overload_bench.TENANTS.values())
    keys = {t.name: f"key-of-{t.name}-0123456789" for t in tenants}
    path = tmp_path / "keys"
    path.write_text(keys_file_text(tenants, keys))
    table = ApiKeys.from_file(str(path))
    shed = table.authenticate(keys["tenant-sheddable"])
    assert shed.default_class == Priority.SHEDDABLE and shed.max_class == Priority.CRITICAL
    cfg = cluster_config(OverloadBenchConfig(waiting_room_size=8), RunSettings(), path, 2)
    assert cfg.gateways == 2 and cfg.api_keys_file == str(path)
    assert cfg.gateway_args == "--waiting-room-size 8" and cfg.placement == "redis"


def test_fairness_phases() -> None:
    plan = fairness_bench.phase_plan(0.5, FairnessBenchConfig())
    assert [p.label for p in plan] == ["backlogged", "backlogged_2gw", "alone", "noisy",
                                       "alone_2gw", "noisy_2gw"]  # fmt: skip
    by = {p.label: {s.tenant: (s.rate, s.gateway) for s in p.streams} for p in plan}
    assert by["noisy"] == {"tenant-a": (2.5, 0), "tenant-b": (0.5, 0), "tenant-c": (0.5, 0)}
    assert by["noisy_2gw"] == {"tenant-a": (2.5, 0), "tenant-b": (0.5, 1),
                               "tenant-c": (0.5, 1)}  # fmt: skip
    assert by["alone_2gw"] == {"tenant-b": (0.5, 1), "tenant-c": (0.5, 1)}
    assert by["backlogged"]["tenant-a"] == (1.0, 0)


def _served(tenant: str, ttft: float, priority: Priority = STD) -> FlowRecord:
    rec = FlowRecord("r", tenant, priority, 0, 0.0, first_token_s=ttft, finished_s=ttft + 2)
    rec.prompt_tokens, rec.output_tokens = 200, 32
    return rec


def _search() -> SearchResult:
    probe = Probe(1.0, 20.0, 20, 19, 0.95, 0.95, 30.4)
    return SearchResult(
        1.0, Qualifier.BRACKETED, probe, [probe, Probe(2.0, 20.0, 40, 8, 0.2, 0.4, 1)]
    )


def test_overload_report_table_and_docs_section(tmp_path: Path) -> None:
    cfg = OverloadBenchConfig(duration_s=15)
    streams = [FlowStream("tenant-critical", Priority.CRITICAL, 0.6),
               FlowStream("tenant-standard", STD, 1.5)]  # fmt: skip
    records = [_served("tenant-critical", 1.0, Priority.CRITICAL), _served("tenant-standard", 6)]
    summary = summarize_phase("overload", streams, 15.0, records, cfg.slo(), {})
    ratio = summary.goodput.requests_per_s / 0.95
    report = overload_bench.OverloadReport(
        overload_bench.SCHEMA, RunSettings(), cfg, {"standard": 5.0}, _search(), 3.0, summary,
        0.95, ratio, 0, 1, CLEAN, overload_bench.targets(cfg, summary, ratio, CLEAN))  # fmt: skip
    table = overload_bench.format_table(report)
    assert "PASS  critical attainment" in table and "FAIL  served past budget" in table
    assert "FAIL  goodput ratio" in table and "leaks after the run: none" in table
    path = write_result(tmp_path / "overload.json", report, PROVENANCE)
    page = "\n".join(section(read_result(path), "overload.json"))
    assert "## Overload: admission control at 3x capacity" in page
    assert "| critical | 10 | 1 | 1 | 1.00 |" in page and "**not met**" in page


def test_fairness_isolation_targets_and_docs_section(tmp_path: Path) -> None:
    cfg = FairnessBenchConfig(share_rate=0.5)
    slo = cfg.slo()
    plan = {p.label: p.streams for p in fairness_bench.phase_plan(0.5, cfg)}
    both = [_served("tenant-b", 1.0), _served("tenant-c", 1.0)]
    noisy = [_served("tenant-a", 1.0), _served("tenant-b", 1.0), _served("tenant-c", 9.0)]
    runs = (("backlogged", noisy), ("alone", both), ("noisy", noisy))
    phases = [summarize_phase(label, plan[label], 10.0, recs, slo, {}) for label, recs in runs]
    iso = fairness_bench.isolation(phases)
    assert [(i.tenant, i.ratio) for i in iso] == [("tenant-b", 1.0), ("tenant-c", 0.0)]
    jain = {"backlogged": phases[0].kv_jain_index}
    assert jain["backlogged"] == pytest.approx(1.0)
    leaks = [fairness_bench.PhaseLeaks(p.label, CLEAN) for p in phases]
    targets = fairness_bench.targets(cfg, iso, jain, leaks)
    assert [t.met for t in targets] == [True, False, True, True]
    search = SearchResult(1.5, Qualifier.GIVEN, None, [])
    report = fairness_bench.FairnessReport(fairness_bench.SCHEMA, RunSettings(), cfg, 0.5, search,
                                           phases, iso, jain, leaks, targets)  # fmt: skip
    table = fairness_bench.format_table(report)
    assert "FAIL  tenant-c attainment noisy / alone" in table
    path = write_result(tmp_path / "fairness.json", report, PROVENANCE)
    page = "\n".join(section(read_result(path), "fairness.json"))
    assert (
        "## Noisy neighbour" in page
        and "| tenant-c | noisy / alone | 1.00 | 0.00 | 0.00x |" in page
    )


def test_tenant_line() -> None:
    assert Tenant("tenant-a", STD, STD).line("k" * 16) == (
        f"tenant-a {'k' * 16} class=standard max_class=standard weight=1"
    )

"""The chart's PrometheusRule run by Prometheus' own `promtool` (where it is installed,
`tests/unit/helm/promtool.py`): every rule and dashboard query parses, each alert fires
on the situation it describes and stays quiet on a healthy cluster, and the cost rule
records what it says. The rule's shape and the dashboard's are checked without promtool
in `test_chart_monitoring.py`, which this file shares its names with.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tests.unit.helm import promtool
from tests.unit.helm.chart import Manifest, load_values, render
from tests.unit.helm.test_chart_monitoring import (
    ALERTS,
    COST,
    DASHBOARD,
    DECODE,
    GATEWAY,
    PREFILL,
    ROOF,
    SLO_VALUES,
    dashboard_queries,
    the_rule,
)

pytest.importorskip("helm_python")


@pytest.fixture(scope="module")
def slo_docs() -> list[Manifest]:
    return render(load_values(SLO_VALUES))


@promtool.needs_promtool
def test_prometheus_parses_every_rule_and_dashboard_query(
    slo_docs: list[Manifest], tmp_path: Path
) -> None:
    promtool.check_rules(the_rule(slo_docs)["spec"]["groups"], tmp_path)
    board = json.loads(DASHBOARD.read_text())
    concrete = {
        f"dashboard_{i}": expr.replace("$__rate_interval", "1m").replace("$", "")
        for i, expr in enumerate(dashboard_queries(board))
    }
    promtool.check_rules(promtool.records(concrete), tmp_path)


def _series(name: str, selector: str, labels: str, values: str) -> dict[str, str]:
    sep = "," if labels else ""
    return {"series": f"{name}{{{selector}{sep}{labels}}}", "values": values}


def _firing(at: str, alertname: str, *labels: dict[str, str]) -> dict[str, Any]:
    return {"eval_time": at, "alertname": alertname,
            "exp_alerts": [{"exp_labels": dict(lbl)} for lbl in labels]}  # fmt: skip


@promtool.needs_promtool
def test_alerts_fire_on_what_they_describe_and_not_on_a_healthy_cluster(
    slo_docs: list[Manifest], tmp_path: Path
) -> None:
    """The ci values: objective 0.995, TTFT p90 0.5 s, ITL p90 0.05 s, KV 0.9, worker
    errors 5%, capacity refusals 5%, a 20% drop from the 1d baseline; series every minute."""
    groups = copy.deepcopy(the_rule(slo_docs)["spec"]["groups"])
    for group in groups:  # annotations are text for people; the labels are what routes
        for r in group["rules"]:
            r.pop("annotations", None)
    gateway = {"namespace": "serving", "service": "rel-pdserve-gateway", "team": "serving"}
    decode = {"namespace": "serving", "service": "rel-pdserve-decode", "team": "serving"}
    prefill = {**decode, "service": "rel-pdserve-prefill"}
    finished = 'finish_reason="stop",priority="standard"'

    # 20% of finished requests miss the SLO: both fast-burn pairs page within 30 minutes.
    burning = {
        "interval": "1m",
        "input_series": [
            _series("pdserve_requests_total", GATEWAY, finished, "0+100x60"),
            _series("pdserve_goodput_requests_total", GATEWAY, "", "0+80x60"),
            _series("pdserve_slo_violations_total", GATEWAY, 'slo="ttft"', "0+20x60"),
            _series("pdserve_slo_violations_total", GATEWAY, 'slo="itl"', "0+1x60"),
        ],
        "alert_rule_test": [
            _firing("30m", "PdserveErrorBudgetBurn1h", {**gateway, "severity": "critical"}),
            _firing("30m", "PdserveErrorBudgetBurn6h", {**gateway, "severity": "critical"}),
            _firing("30m", "PdserveErrorBudgetBurn1d"),  # its `for` is 1h
            _firing("30m", "PdserveITLSLOBurn"),  # the misses are TTFT's; ITL's are 1%
        ],
    }
    # 10% of finished requests miss the ITL SLO (> 14.4 x 0.5%): the ITL burn pages.
    itl_burning = {
        "interval": "1m",
        "input_series": [
            _series("pdserve_requests_total", GATEWAY, finished, "0+100x60"),
            _series("pdserve_goodput_requests_total", GATEWAY, "", "0+90x60"),
            _series("pdserve_slo_violations_total", GATEWAY, 'slo="itl"', "0+10x60"),
        ],
        "alert_rule_test": [
            _firing("1m", "PdserveITLSLOBurn"),  # pending: not yet 2m
            _firing("30m", "PdserveITLSLOBurn", {**gateway, "severity": "critical"}),
        ],
    }
    # Of 150 admission decisions a minute, 10 are capacity refusals (6.7% > 5%); the 50
    # quota refusals count only among the decisions.
    refusing = {
        "interval": "1m",
        "input_series": [
            _series("pdserve_gateway_admitted_total", GATEWAY, 'class="standard",waited="no"',
                    "0+80x30"),
            _series("pdserve_gateway_admitted_total", GATEWAY, 'class="standard",waited="yes"',
                    "0+10x30"),
            _series("pdserve_gateway_refused_total", GATEWAY, 'class="standard",reason="quota"',
                    "0+50x30"),
            _series("pdserve_gateway_refused_total", GATEWAY,
                    'class="standard",reason="room_full"', "0+6x30"),
            _series("pdserve_gateway_refused_total", GATEWAY, 'class="batch",reason="budget"',
                    "0+4x30"),
        ],
        "alert_rule_test": [
            _firing("5m", "PdserveAdmissionRefusals"),  # pending: not yet refusalsFor
            _firing("20m", "PdserveAdmissionRefusals", {**gateway, "severity": "warning"}),
        ],
    }  # fmt: skip
    # All requests good, but server errors (UNAVAILABLE) are 1/6 of the traffic: a burn
    # too; client errors (INVALID_ARGUMENT) alone would not be.
    failing = {
        "interval": "1m",
        "input_series": [
            _series("pdserve_requests_total", GATEWAY, finished, "0+100x60"),
            _series("pdserve_goodput_requests_total", GATEWAY, "", "0+100x60"),
            _series("pdserve_request_errors_total", GATEWAY, 'code="UNAVAILABLE"', "0+20x60"),
            _series("pdserve_request_errors_total", GATEWAY, 'code="INVALID_ARGUMENT"', "0+50x60"),
        ],
        "alert_rule_test": [
            _firing("30m", "PdserveErrorBudgetBurn1h", {**gateway, "severity": "critical"}),
        ],
    }
    # Every first token between 1 s and 2.5 s (p90 2.35 s > 0.5 s) and every token gap
    # between 0.1 s and 0.25 s (> 0.05 s), for longer than latencyFor (10m).
    slow = {
        "interval": "1m",
        "input_series": [
            _series("pdserve_time_to_first_token_seconds_bucket", GATEWAY, 'le="1.0"', "0x40"),
            _series("pdserve_time_to_first_token_seconds_bucket", GATEWAY, 'le="2.5"', "0+10x40"),
            _series("pdserve_time_to_first_token_seconds_bucket", GATEWAY, 'le="+Inf"', "0+10x40"),
            _series("pdserve_inter_token_latency_seconds_bucket", GATEWAY, 'le="0.1"', "0x40"),
            _series("pdserve_inter_token_latency_seconds_bucket", GATEWAY, 'le="0.25"', "0+99x40"),
            _series("pdserve_inter_token_latency_seconds_bucket", GATEWAY, 'le="+Inf"', "0+99x40"),
        ],
        "alert_rule_test": [
            _firing("5m", "PdserveTTFTP90High"),  # pending: not yet latencyFor
            _firing("25m", "PdserveTTFTP90High", {**gateway, "severity": "warning"}),
            _firing("25m", "PdserveITLP90High", {**gateway, "severity": "warning"}),
        ],
    }
    # Fast requests, few capacity refusals (6 of 156 decisions; 56 with quota's), steady
    # speculative acceptance (70%) and prefix hits (50%): nothing fires, neither at 30m
    # nor at 140m, when the drop alerts have a baseline to compare with.
    fast = {
        "interval": "1m",
        "input_series": [
            _series("pdserve_time_to_first_token_seconds_bucket", GATEWAY, 'le="0.25"', "0+10x150"),
            _series("pdserve_time_to_first_token_seconds_bucket", GATEWAY, 'le="+Inf"', "0+10x150"),
            _series("pdserve_requests_total", GATEWAY, finished, "0+100x150"),
            _series("pdserve_goodput_requests_total", GATEWAY, "", "0+100x150"),
            _series("pdserve_slo_violations_total", GATEWAY, 'slo="itl"', "0x150"),
            _series("pdserve_gateway_admitted_total", GATEWAY, 'class="standard",waited="no"',
                    "0+100x150"),
            _series("pdserve_gateway_refused_total", GATEWAY, 'class="standard",reason="quota"',
                    "0+50x150"),
            _series("pdserve_gateway_refused_total", GATEWAY,
                    'class="standard",reason="stream_cap"', "0+6x150"),
            _series("pdserve_spec_tokens_total", DECODE, 'pod="d0",kind="drafted"', "0+100x150"),
            _series("pdserve_spec_tokens_total", DECODE, 'pod="d0",kind="accepted"', "0+70x150"),
            _series("pdserve_prefix_prompt_tokens_total", DECODE, 'pod="d0"', "0+1000x150"),
            _series("pdserve_prefix_cached_tokens_total", DECODE, 'pod="d0"', "0+500x150"),
        ],
        "alert_rule_test": [_firing(at, name) for at in ("30m", "140m") for name in sorted(ALERTS)],
    }  # fmt: skip
    # After an hour, the decode pool's acceptance falls from 80% to 40% and the prefill
    # pool's prefix hits from 60% to 20%; the decode pool's hits stay at 50% and the
    # prefill pool drafts nothing (0 / 0: no alert). Each drop alert starts pending about
    # 10 minutes in and fires dropFor (30m) later, for its pool only.
    regressing = {
        "interval": "1m",
        "input_series": [
            _series("pdserve_spec_tokens_total", DECODE, 'pod="d0",kind="drafted"', "0+100x131"),
            _series("pdserve_spec_tokens_total", DECODE, 'pod="d0",kind="accepted"',
                    "0+80x60 4840+40x70"),
            _series("pdserve_prefix_prompt_tokens_total", DECODE, 'pod="d0"', "0+1000x131"),
            _series("pdserve_prefix_cached_tokens_total", DECODE, 'pod="d0"', "0+500x131"),
            _series("pdserve_spec_tokens_total", PREFILL, 'pod="p0",kind="drafted"', "0x131"),
            _series("pdserve_spec_tokens_total", PREFILL, 'pod="p0",kind="accepted"', "0x131"),
            _series("pdserve_prefix_prompt_tokens_total", PREFILL, 'pod="p0"', "0+1000x131"),
            _series("pdserve_prefix_cached_tokens_total", PREFILL, 'pod="p0"',
                    "0+600x60 36200+200x70"),
        ],
        "alert_rule_test": [
            _firing("80m", "PdserveSpecAcceptanceFalling"),  # pending
            _firing("80m", "PdservePrefixHitRateFalling"),
            _firing("115m", "PdserveSpecAcceptanceFalling", {**decode, "severity": "warning"}),
            _firing("115m", "PdservePrefixHitRateFalling", {**prefill, "severity": "warning"}),
        ],
    }  # fmt: skip
    # Decode pool 97% full; its workers fail 50% of their RPCs; a prefill worker that
    # never scheduled anything fails all its RPCs (no queue-time series at all). CANCELLED
    # (the caller went away) is not a worker error.
    workers = {
        "interval": "1m",
        "input_series": [
            _series("pdserve_kv_blocks", DECODE, 'pod="d0",state="used"', "97x30"),
            _series("pdserve_kv_blocks", DECODE, 'pod="d0",state="total"', "100x30"),
            _series("pdserve_kv_blocks", PREFILL, 'pod="p0",state="used"', "10x30"),
            _series("pdserve_kv_blocks", PREFILL, 'pod="p0",state="total"', "100x30"),
            _series("pdserve_request_errors_total", DECODE, 'pod="d0",code="INTERNAL"', "0+10x30"),
            _series("pdserve_queue_time_seconds_count", DECODE, 'pod="d0",phase="decode"',
                    "0+10x30"),
            _series("pdserve_request_errors_total", PREFILL, 'pod="p0",code="UNAVAILABLE"',
                    "0+3x30"),
            _series("pdserve_request_errors_total", PREFILL, 'pod="p0",code="CANCELLED"',
                    "0+50x30"),
        ],
        "alert_rule_test": [
            _firing("20m", "PdserveKVCacheNearlyFull", {**decode, "severity": "warning"}),
            _firing("20m", "PdserveWorkerErrors", {**decode, "severity": "warning"},
                    {**prefill, "severity": "warning"}),
        ],
    }  # fmt: skip
    cases = [burning, itl_burning, failing, refusing, slow, fast, regressing, workers]
    promtool.run_rule_tests(groups, cases, tmp_path)


@promtool.needs_promtool
def test_cost_rule_is_the_release_cost_per_million_goodput_tokens(
    slo_docs: list[Manifest], tmp_path: Path
) -> None:
    """Gateways 2 x 3, prefill 8, decode 16 an hour (the Router's 5 and another release's
    100 not counted): 30 an hour; 10,000 goodput tokens a minute, 0.6 million an hour: 50
    per million. With no cost set (every pod at 0) the rule records nothing."""
    groups = the_rule(slo_docs)["spec"]["groups"]
    router = 'namespace="serving",service="rel-pdserve-router"'
    other = 'namespace="other",service="rel-pdserve-decode"'
    tokens = [
        _series("pdserve_goodput_tokens_total", GATEWAY, f'pod="g{i}",model="m"', "0+5000x80")
        for i in range(2)
    ]
    costs = [(GATEWAY, "g0", 3), (GATEWAY, "g1", 3), (PREFILL, "p0", 8), (DECODE, "d0", 16),
             (router, "r0", 5), (other, "d0", 100)]  # fmt: skip
    cost_set = [_series("pdserve_node_cost_per_hour", sel, f'pod="{pod}"', f"{cost}x80")
                for sel, pod, cost in costs]  # fmt: skip
    unset = [_series("pdserve_node_cost_per_hour", sel, f'pod="{pod}"', "0x80")
             for sel, pod, _ in costs]  # fmt: skip
    expected = [{"labels": f"{COST}{{{GATEWAY}}}", "value": 50}]
    priced = {
        "interval": "1m",
        "input_series": tokens + cost_set,
        "promql_expr_test": [{"expr": COST, "eval_time": "70m", "exp_samples": expected}],
    }
    unpriced = {
        "interval": "1m",
        "input_series": tokens + unset,
        "promql_expr_test": [{"expr": COST, "eval_time": "70m", "exp_samples": []}],
    }
    promtool.run_rule_tests(groups, [priced, unpriced], tmp_path)


@promtool.needs_promtool
def test_roof_rule_is_each_workers_decode_roof_over_its_decode_time(
    slo_docs: list[Manifest], tmp_path: Path
) -> None:
    """Worker d0: 0.3 s of roof per 0.6 s of decode-only steps a minute: 0.5. Worker p0
    ran no decode-only step: no sample. A gateway's series are not workers'."""
    groups = the_rule(slo_docs)["spec"]["groups"]
    series = [
        _series("pdserve_decode_roof_seconds_total", DECODE, 'pod="d0"', "0+0.3x20"),
        _series("pdserve_decode_only_busy_seconds_total", DECODE, 'pod="d0"', "0+0.6x20"),
        _series("pdserve_decode_roof_seconds_total", PREFILL, 'pod="p0"', "0x20"),
        _series("pdserve_decode_only_busy_seconds_total", PREFILL, 'pod="p0"', "0x20"),
        _series("pdserve_decode_roof_seconds_total", GATEWAY, 'pod="g0"', "0+1x20"),
        _series("pdserve_decode_only_busy_seconds_total", GATEWAY, 'pod="g0"', "0+1x20"),
    ]
    expected = [{"labels": f'{ROOF}{{{DECODE},pod="d0"}}', "value": 0.5}]
    case = {
        "interval": "1m",
        "input_series": series,
        "promql_expr_test": [{"expr": ROOF, "eval_time": "15m", "exp_samples": expected}],
    }
    promtool.run_rule_tests(groups, [case], tmp_path)

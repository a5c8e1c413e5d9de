"""Alerts (PrometheusRule) and the Grafana dashboard: off by default, built only from
metrics pdserve exports, with thresholds from values.

Every expression and panel query is checked against the series the services' own metric
classes export (`promql.exported_series`). With `promtool` installed the rules are also
parsed by Prometheus and evaluated over synthetic series (`test_chart_rules_promtool.py`):
each alert fires on the situation it describes and stays quiet on a healthy one.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from services.common.telemetry_config import TelemetryConfig
from services.gateway.stream.metrics import GatewayMetrics
from tests.unit.helm.chart import CHART, Manifest, by_kind, load_values, notes, render
from tests.unit.helm.promql import (
    FUNCTIONS,
    all_exported,
    exported_families,
    exported_series,
    functions_called,
    metric_literals_in_source,
    metric_names,
)

pytest.importorskip("helm_python")

SLO_VALUES = CHART / "ci" / "slo-autoscaling-values.yaml"
DASHBOARD = CHART / "dashboards" / "pdserve.json"
ALERTS = {
    "PdserveErrorBudgetBurn1h", "PdserveErrorBudgetBurn6h", "PdserveErrorBudgetBurn1d",
    "PdserveErrorBudgetBurn3d", "PdserveTTFTP90High", "PdserveITLP90High",
    "PdserveKVCacheNearlyFull", "PdserveWorkerErrors", "PdserveITLSLOBurn",
    "PdserveAdmissionRefusals", "PdserveSpecAcceptanceFalling", "PdservePrefixHitRateFalling",
}  # fmt: skip
#: Metric families the dashboard must chart (the issue's list).
DASHBOARD_FAMILIES = {
    "pdserve_time_to_first_token_seconds", "pdserve_inter_token_latency_seconds",
    "pdserve_e2e_request_latency_seconds", "pdserve_goodput_requests", "pdserve_requests",
    "pdserve_request_errors", "pdserve_active_streams", "pdserve_prompt_tokens",
    "pdserve_cached_prompt_tokens", "pdserve_output_tokens", "pdserve_num_requests_waiting",
    "pdserve_kv_blocks", "pdserve_kv_offload_blocks", "pdserve_kv_offload_hit_tokens",
    "pdserve_kv_offload_blocks_moved", "pdserve_kv_transfer_bytes",
    "pdserve_kv_transfer_seconds", "pdserve_router_decisions", "pdserve_router_fail_open",
    "pdserve_slo_violations", "pdserve_gateway_waiting_room", "pdserve_decode_roof_seconds",
    "pdserve_decode_only_busy_seconds", "pdserve_preemption_resume_tokens",
}  # fmt: skip
GATEWAY = 'namespace="serving",service="rel-pdserve-gateway"'
DECODE = 'namespace="serving",service="rel-pdserve-decode"'
PREFILL = 'namespace="serving",service="rel-pdserve-prefill"'
WORKERS = 'namespace="serving",service=~"rel-pdserve-prefill|rel-pdserve-decode"'
#: The gateway's and the worker pools' Services together: what the release's pods cost.
SERVED = 'namespace="serving",service=~"rel-pdserve-gateway|rel-pdserve-prefill|rel-pdserve-decode"'
COST = "pdserve:cost_per_million_goodput_tokens:rate1h"
ROOF = "pdserve:decode_roof_fraction:rate5m"
#: A series name and the namespace/service matchers in front of it.
_SELECTED = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)\{(namespace="[^"]*",service=~?"[^"]*")')


def the_rule(docs: list[Manifest]) -> Manifest:
    (rule,) = by_kind(docs, "PrometheusRule")
    return rule


def rules(rule: Manifest) -> list[dict[str, Any]]:
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


def alerts(rule: Manifest) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for r in rules(rule) if "alert" in r}


def dashboard_queries(board: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        if var["type"] == "query":  # label_values(SELECTOR, LABEL): the selector is PromQL
            exprs.append(var["query"].removeprefix("label_values(").rsplit(",", 1)[0])
    return exprs


@pytest.fixture(scope="module")
def slo_docs() -> list[Manifest]:
    return render(load_values(SLO_VALUES))


def test_promql_reader_finds_series_names_only() -> None:
    expr = (
        'sum by (le, service) (rate(a_bucket{x="y{",z=~"$ns"}[$__rate_interval])) '
        "/ on() group_left b offset 5m > 1e3 or vector(0) and pdserve:c:rate5m > 14.4 * (1 - 0.99)"
    )
    assert metric_names(expr) == {"a_bucket", "b", "pdserve:c:rate5m"}
    assert functions_called(expr) == {"sum", "rate", "vector"}
    assert metric_names("histogram_quantle(0.9, x)") == {"x"}
    assert "histogram_quantle" not in FUNCTIONS


def test_the_exported_catalog_covers_every_metric_in_the_source() -> None:
    """`exported_families` registers every metric class the services define: a metric
    name written in services/ that it does not produce means a class is missing there."""
    families = set().union(*exported_families().values())
    missing = {n: f for n, f in metric_literals_in_source().items() if n not in families}
    assert not missing, f"add their classes to promql.exported_families: {missing}"


def test_alerts_and_dashboard_are_off_by_default() -> None:
    docs = render(None)
    assert not by_kind(docs, "PrometheusRule")
    assert not [c for c in by_kind(docs, "ConfigMap") if "pdserve.json" in c.get("data", {})]
    # Both need the metrics endpoints: without them nothing is rendered, and NOTES say so.
    off = {"metrics": {"prometheusRule": {"enabled": True}, "dashboard": {"enabled": True}}}
    assert not by_kind(render(off), "PrometheusRule")
    assert "metrics.prometheusRule and metrics.dashboard have no effect" in notes(off)


def test_rule_is_selected_and_grouped_as_prometheus_needs(slo_docs: list[Manifest]) -> None:
    rule = the_rule(slo_docs)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    names = [g["name"] for g in rule["spec"]["groups"]]
    assert len(names) == len(set(names))
    assert set(alerts(rule)) == ALERTS


def test_rule_expressions_read_only_exported_or_recorded_series(slo_docs: list[Manifest]) -> None:
    rule = the_rule(slo_docs)
    exported = all_exported()
    recorded = {r["record"] for r in rules(rule) if "record" in r}
    windows = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
    assert recorded == {f"pdserve:slo_error_ratio:rate{w}" for w in windows} | {COST, ROOF}
    for r in rules(rule):
        read = metric_names(r["expr"])
        assert read and read <= exported | recorded, (r.get("alert") or r["record"], read)
        assert functions_called(r["expr"]) <= FUNCTIONS


def test_rules_select_the_gateway_and_worker_services(slo_docs: list[Manifest]) -> None:
    """Every series a rule reads is selected by the release's namespace and the Services
    that export it: the gateway's, the worker pools', or both (the Router's never)."""
    series = exported_series()
    roles_of = {GATEWAY: {"gateway"}, WORKERS: {"worker"}, SERVED: {"gateway", "worker"}}
    rule = the_rule(slo_docs)
    recorded = {r["record"] for r in rules(rule) if "record" in r}
    for r in rules(rule):
        expr = r["expr"]
        selected = [(n, sel) for n, sel in _SELECTED.findall(expr) if n not in recorded]
        assert {n for n, _ in selected} == metric_names(expr) - recorded, expr
        for name, selector in selected:
            exporters = {role for role, names in series.items() if name in names}
            assert roles_of[selector] <= exporters, (name, selector)
    # pdserve_node_cost_per_hour comes from every process: the cost is the gateway's and
    # the pools' pods, with the pools the chart runs.
    cost = next(r["expr"] for r in rules(rule) if r.get("record") == COST)
    assert f"pdserve_node_cost_per_hour{{{SERVED}}}" in cost
    mixed = the_rule(render({"metrics": {"enabled": True, "prometheusRule": {"enabled": True}},
                             "prefill": {"enabled": False}}))  # fmt: skip
    kv = alerts(mixed)["PdserveKVCacheNearlyFull"]["expr"]
    assert 'service="rel-pdserve-decode"' in kv and "prefill" not in kv
    cost = next(r["expr"] for r in rules(mixed) if r.get("record") == COST)
    assert 'service=~"rel-pdserve-gateway|rel-pdserve-decode"}' in cost and "prefill" not in cost


def test_burn_rate_alerts_pair_long_and_short_windows(slo_docs: list[Manifest]) -> None:
    by_name = alerts(the_rule(slo_docs))
    budget = "(1 - 0.995)"  # objective 0.995 in the ci values
    for name, factor, long, short, severity in [
        ("PdserveErrorBudgetBurn1h", "14.4", "1h", "5m", "critical"),
        ("PdserveErrorBudgetBurn6h", "6", "6h", "30m", "critical"),
        ("PdserveErrorBudgetBurn1d", "3", "1d", "2h", "warning"),
        ("PdserveErrorBudgetBurn3d", "1", "3d", "6h", "warning"),
    ]:
        alert = by_name[name]
        assert metric_names(alert["expr"]) == {
            f"pdserve:slo_error_ratio:rate{long}",
            f"pdserve:slo_error_ratio:rate{short}",
        }
        assert alert["expr"].count(f"> ({factor} * {budget})") == 2
        assert "\nand\n" in alert["expr"]
        assert alert["labels"]["severity"] == severity
        assert alert["labels"]["team"] == "serving"  # alertLabels
    itl = by_name["PdserveITLSLOBurn"]
    assert metric_names(itl["expr"]) == {"pdserve_slo_violations_total", "pdserve_requests_total"}
    long, short = itl["expr"].split("\nand\n")
    for part, window in ((long, "1h"), (short, "5m")):
        assert part.count(f"[{window}]") == 2 and part.endswith(f"> (14.4 * {budget})")
        assert f'pdserve_slo_violations_total{{{GATEWAY},slo="itl"}}[{window}]' in part
    assert itl["for"] == "2m"
    assert itl["labels"] == {"severity": "critical", "namespace": "serving",
                             "service": "rel-pdserve-gateway", "team": "serving"}  # fmt: skip


def test_thresholds_and_durations_come_from_values() -> None:
    mr = {"enabled": True, "objective": 0.95, "ttftP90Seconds": 2.5, "itlP90Seconds": 0.2,
          "quantileWindow": "10m", "latencyFor": "20m", "kvUtilization": 0.85, "kvFor": "15m",
          "workerErrorRatio": 0.1, "workerErrorsFor": "7m",
          "refusalRatio": 0.02, "refusalsFor": "12m", "baselineWindow": "3d",
          "dropWindow": "1h", "baselineDrop": 0.5, "dropFor": "45m",
          "sloErrorCodes": ["INTERNAL"],
          "workerErrorIgnoredCodes": ["CANCELLED", "NOT_FOUND"]}  # fmt: skip
    rule = the_rule(render({"metrics": {"enabled": True, "prometheusRule": mr}}))
    by_name = alerts(rule)
    ttft, itl = by_name["PdserveTTFTP90High"], by_name["PdserveITLP90High"]
    assert ttft["expr"].endswith("> 2.5") and ttft["for"] == "20m" and "[10m]" in ttft["expr"]
    assert itl["expr"].endswith("> 0.2") and itl["for"] == "20m"
    kv = by_name["PdserveKVCacheNearlyFull"]
    assert kv["expr"].endswith("> 0.85") and kv["for"] == "15m"
    errors = by_name["PdserveWorkerErrors"]
    assert errors["expr"].endswith("> 0.1") and errors["for"] == "7m"
    assert 'code!~"CANCELLED|NOT_FOUND"' in errors["expr"]
    assert "(14.4 * (1 - 0.95))" in by_name["PdserveErrorBudgetBurn1h"]["expr"]
    assert by_name["PdserveITLSLOBurn"]["expr"].count("> (14.4 * (1 - 0.95))") == 2
    refusals = by_name["PdserveAdmissionRefusals"]
    assert refusals["expr"].endswith("> 0.02") and refusals["for"] == "12m"
    for name in ("PdserveSpecAcceptanceFalling", "PdservePrefixHitRateFalling"):
        drop = by_name[name]
        assert drop["for"] == "45m" and "\n< (1 - 0.5) * (\n" in drop["expr"]
        assert drop["expr"].count("[1h]))") == 2  # the recent window
        assert drop["expr"].count("[3d] offset 1h))") == 2  # the baseline before it
    record = next(r for r in rules(rule) if r.get("record") == "pdserve:slo_error_ratio:rate5m")
    assert 'code=~"INTERNAL"' in record["expr"]


def test_default_thresholds_match_the_gateways_goodput_slos() -> None:
    """The p90 alerts default to the services' goodput SLOs, and the autoscaling targets
    sit below them, so the pools grow before the alerts fire."""
    defaults = {f.name: f.default for f in dataclasses.fields(TelemetryConfig)}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    alert, target = values["metrics"]["prometheusRule"], values["autoscaling"]["targets"]
    assert alert["ttftP90Seconds"] == defaults["slo_ttft_s"] > target["ttftP90Seconds"]
    assert alert["itlP90Seconds"] == defaults["slo_itl_s"] > target["itlP90Seconds"]
    assert alert["kvUtilization"] > target["kvUtilization"]


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"objective": 1.0}, "objective"),
        ({"sloErrorCodes": ["UNAVAILABLE", "TIMEOUT"]}, "sloErrorCodes"),
        ({"latencyFor": "10 minutes"}, "latencyFor"),
        ({"kvUtilization": 1.5}, "kvUtilization"),
        ({"baselineDrop": 0}, "baselineDrop"),
        ({"dropWindow": "half an hour"}, "dropWindow"),
    ],
)
def test_impossible_alert_values_are_refused(values: dict[str, Any], match: str) -> None:
    import helm_python

    with pytest.raises(helm_python.HelmValuesError, match=match):
        render({"metrics": {"enabled": True, "prometheusRule": {"enabled": True, **values}}})


def test_grpc_code_names_in_the_schema_are_the_ones_the_services_count() -> None:
    import grpc

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["definitions"]["grpcCodes"]["items"]["enum"] == [c.name for c in grpc.StatusCode]


def test_dashboard_configmap_is_labelled_for_the_grafana_sidecar(slo_docs: list[Manifest]) -> None:
    (cm,) = [c for c in by_kind(slo_docs, "ConfigMap") if "pdserve.json" in c.get("data", {})]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "pdserve"}
    assert json.loads(cm["data"]["pdserve.json"]) == json.loads(DASHBOARD.read_text())
    custom = render({"metrics": {"enabled": True, "dashboard": {
        "enabled": True, "labels": {"grafana_dashboard": "pdserve"}}}})  # fmt: skip
    (cm,) = [c for c in by_kind(custom, "ConfigMap") if "pdserve.json" in c.get("data", {})]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "pdserve"
    assert cm["metadata"]["namespace"] == "serving"


def test_dashboard_queries_only_exported_metrics() -> None:
    board = json.loads(DASHBOARD.read_text())
    exported = all_exported()
    queries = dashboard_queries(board)
    assert len(queries) > 40
    for expr in queries:
        read = metric_names(expr)
        assert read and read <= exported, (expr, read - exported)
        assert functions_called(expr) <= FUNCTIONS | {"label_values"}, expr


def test_dashboard_covers_the_metrics_operators_need() -> None:
    board = json.loads(DASHBOARD.read_text())
    read = set().union(*(metric_names(e) for e in dashboard_queries(board)))
    families = {
        name
        for name in DASHBOARD_FAMILIES
        if read & {name, f"{name}_total", f"{name}_bucket", f"{name}_count"}
    }
    assert families == DASHBOARD_FAMILIES


def test_dashboard_is_well_formed_for_grafana() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "pdserve" and board["title"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "namespace", "gateway", "model", "workers", "router"} <= variables
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for t in panel["targets"]:
            used = {v for v in variables if f"${v}" in t["expr"]}
            assert "namespace" in used, (panel["title"], t["expr"])


def test_gateway_request_panels_follow_the_model_variable() -> None:
    """Every query of a gateway request metric (labelled by model) selects `$model`."""
    metrics = vars(GatewayMetrics(CollectorRegistry(), 1.0, 1.0)).values()
    # prometheus_client keeps a metric's label names only in `_labelnames`.
    by_model = {m._name for m in metrics if "model" in getattr(m, "_labelnames", ())}
    assert "pdserve_time_to_first_token_seconds" in by_model and len(by_model) >= 12
    board = json.loads(DASHBOARD.read_text())
    panels = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    read = [e for e in panels if "$gateway" in e]
    filtered = [e for e in read if metric_names(e) & _families(by_model)]
    assert len(filtered) >= 15
    assert all('model=~"$model"' in e for e in filtered), filtered


def _families(names: set[str]) -> set[str]:
    """The scraped names a family's metric names are read as (suffixes added)."""
    return {n + s for n in names for s in ("", "_total", "_bucket", "_count", "_sum")}

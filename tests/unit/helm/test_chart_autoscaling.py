"""KEDA autoscaling of the worker pools: what the ScaledObjects scale, on which signals,
and that nothing else fights them for the pools' size.

Each trigger's query must read series the services really export (built from their own
metric classes, `promql.exported_series`) from the right Services; with `promtool`
installed the queries are also evaluated over synthetic series, so "no traffic", "some
traffic" and "Prometheus lost the targets" give 0, the p90 and no value respectively.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from tests.unit.helm import promtool
from tests.unit.helm.chart import (
    CHART,
    Manifest,
    by_kind,
    component,
    load_values,
    named,
    notes,
    render,
)
from tests.unit.helm.promql import FUNCTIONS, exported_series, functions_called, metric_names

helm_python = pytest.importorskip("helm_python")

SLO_VALUES = CHART / "ci" / "slo-autoscaling-values.yaml"
#: Which triggers each worker role gets, and whose metrics each reads.
TRIGGERS = {
    "prefill": {"ttft-p90", "queued-prompt-tokens"},
    "decode": {"itl-p90", "kv-utilization"},
    "mixed": {"ttft-p90", "queued-prompt-tokens", "itl-p90", "kv-utilization"},
}
SOURCE = {"ttft-p90": "gateway", "itl-p90": "gateway", "queued-prompt-tokens": "worker",
          "kv-utilization": "worker"}  # fmt: skip
TARGET_KEY = {"ttft-p90": "ttftP90Seconds", "itl-p90": "itlP90Seconds",
              "queued-prompt-tokens": "queuedPromptTokensPerWorker",
              "kv-utilization": "kvUtilization"}  # fmt: skip
BOTH_POOLS = {"metrics": {"enabled": True},
              "prefill": {"autoscaling": {"enabled": True}},
              "decode": {"autoscaling": {"enabled": True}}}  # fmt: skip


def scaled_objects(docs: list[Manifest]) -> dict[str, Manifest]:
    return {component(s): s for s in by_kind(docs, "ScaledObject")}


def triggers(scaled: Manifest) -> dict[str, Manifest]:
    return {t["name"]: t for t in scaled["spec"]["triggers"]}


def services_selected(query: str) -> set[str]:
    """The Service names a query's `service=` / `service=~` matchers name."""
    names: set[str] = set()
    for op, value in re.findall(r'\bservice(=~|=)"([^"]*)"', query):
        names |= set(value.split("|")) if op == "=~" else {value}
    return names


@pytest.fixture(scope="module")
def slo_docs() -> list[Manifest]:
    return render(load_values(SLO_VALUES))


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    return exported_series()


def test_autoscaling_is_off_by_default() -> None:
    docs = render(None)
    assert not by_kind(docs, "ScaledObject")
    for pool in ("prefill", "decode"):
        assert named(docs, "Deployment", f"rel-pdserve-{pool}")["spec"]["replicas"] == 1


def test_each_pool_is_scaled_by_one_scaled_object_on_its_deployment(
    slo_docs: list[Manifest],
) -> None:
    values = load_values(SLO_VALUES) or {}
    objects = scaled_objects(slo_docs)
    assert set(objects) == {"prefill", "decode"}
    for pool, scaled in objects.items():
        ref = scaled["spec"]["scaleTargetRef"]
        workload = named(slo_docs, ref["kind"], ref["name"])
        assert ref["apiVersion"] == workload["apiVersion"] == "apps/v1"
        assert component(workload) == pool and ref["name"] == f"rel-pdserve-{pool}"
        # No fixed size for Helm to reset on every upgrade: the HPA KEDA makes owns it.
        assert "replicas" not in workload["spec"]
        spec, want = scaled["spec"], values[pool]["autoscaling"]
        assert spec["minReplicaCount"] == want["minReplicaCount"]
        assert spec["maxReplicaCount"] == want["maxReplicaCount"]
        assert set(triggers(scaled)) == TRIGGERS[pool]


def test_a_mixed_pool_scales_on_both_pools_signals() -> None:
    docs = render({"metrics": {"enabled": True}, "prefill": {"enabled": False},
                   "decode": {"autoscaling": {"enabled": True}}})  # fmt: skip
    (scaled,) = by_kind(docs, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "rel-pdserve-decode"
    assert set(triggers(scaled)) == TRIGGERS["mixed"]
    for trigger in triggers(scaled).values():
        if SOURCE[trigger["name"]] == "worker":
            assert services_selected(trigger["metadata"]["query"]) == {"rel-pdserve-decode"}


def test_one_pool_can_scale_while_the_other_keeps_its_replicas() -> None:
    docs = render({"metrics": {"enabled": True}, "prefill": {"replicas": 3},
                   "decode": {"autoscaling": {"enabled": True}}})  # fmt: skip
    assert set(scaled_objects(docs)) == {"decode"}
    assert named(docs, "Deployment", "rel-pdserve-prefill")["spec"]["replicas"] == 3
    assert "replicas" not in named(docs, "Deployment", "rel-pdserve-decode")["spec"]


def test_an_hpa_of_ones_own_gets_the_pool_without_a_scaled_object() -> None:
    """prometheus-adapter and a hand-written HPA: the chart must only let go of the size."""
    own = {"enabled": True, "scaledObject": False}
    values = {"metrics": {"enabled": True}, "decode": {"autoscaling": own}}
    docs = render(values)
    assert not by_kind(docs, "ScaledObject") and not by_kind(docs, "HorizontalPodAutoscaler")
    assert "replicas" not in named(docs, "Deployment", "rel-pdserve-decode")["spec"]
    assert "an HPA of your own sizes deployment/rel-pdserve-decode" in notes(values)


def test_trigger_queries_read_exported_metrics_from_the_right_services(
    slo_docs: list[Manifest], exported: dict[str, set[str]]
) -> None:
    services = {s["metadata"]["name"]: s for s in by_kind(slo_docs, "Service")}
    for pool, scaled in scaled_objects(slo_docs).items():
        for name, trigger in triggers(scaled).items():
            query = trigger["metadata"]["query"]
            read = metric_names(query)
            assert read and read <= exported[SOURCE[name]], (name, read - exported[SOURCE[name]])
            assert functions_called(query) <= FUNCTIONS
            want = "rel-pdserve-gateway" if SOURCE[name] == "gateway" else f"rel-pdserve-{pool}"
            assert services_selected(query) == {want}, name
            ports = {p["name"] for p in services[want]["spec"]["ports"]}
            assert "metrics" in ports  # what Prometheus scrapes these series from
            assert 'namespace="serving"' in query


def test_the_signals_are_the_ones_the_slos_are_about(slo_docs: list[Manifest]) -> None:
    objects = scaled_objects(slo_docs)
    prefill, decode = triggers(objects["prefill"]), triggers(objects["decode"])
    ttft, itl = prefill["ttft-p90"]["metadata"]["query"], decode["itl-p90"]["metadata"]["query"]
    assert "histogram_quantile(0.9," in ttft and "pdserve_time_to_first_token_seconds" in ttft
    assert "histogram_quantile(0.9," in itl and "pdserve_inter_token_latency_seconds" in itl
    assert metric_names(prefill["queued-prompt-tokens"]["metadata"]["query"]) == {
        "pdserve_num_prompt_tokens_waiting"
    }
    kv = decode["kv-utilization"]["metadata"]["query"]
    assert 'state="used"' in kv and 'state="total"' in kv and "/" in kv
    # Latency and utilisation scale in proportion (replicas x value / target); the queue
    # is shared out per worker (total / target).
    kinds = {n: t["metricType"] for n, t in {**prefill, **decode}.items()}
    assert kinds == {"ttft-p90": "Value", "itl-p90": "Value", "kv-utilization": "Value",
                     "queued-prompt-tokens": "AverageValue"}  # fmt: skip


def test_thresholds_and_keda_settings_come_from_values() -> None:
    values: dict[str, Any] = {
        **BOTH_POOLS,
        "autoscaling": {
            "prometheus": {
                "serverAddress": "https://thanos.example:10902",
                "authenticationRef": "prom-auth",
                "metadata": {"unsafeSsl": True, "timeout": 3000},
            },
            "pollingInterval": 7,
            "cooldownPeriod": 90,
            "window": "3m",
            "targets": {"ttftP90Seconds": 0.35, "queuedPromptTokensPerWorker": 3000,
                        "itlP90Seconds": 0.045, "kvUtilization": 0.7},
        },
    }  # fmt: skip
    docs = render(values)
    for scaled in scaled_objects(docs).values():
        assert scaled["spec"]["pollingInterval"] == 7
        assert scaled["spec"]["cooldownPeriod"] == 90
        for name, trigger in triggers(scaled).items():
            meta = trigger["metadata"]
            assert meta["threshold"] == str(values["autoscaling"]["targets"][TARGET_KEY[name]])
            assert meta["serverAddress"] == "https://thanos.example:10902"
            assert meta["unsafeSsl"] == "true" and meta["timeout"] == "3000"
            # An empty answer is an error (the HPA holds), not a 0 (it would scale down).
            assert meta["ignoreNullValues"] == "false"
            assert trigger["authenticationRef"] == {"name": "prom-auth"}
            if SOURCE[name] == "gateway":
                assert "[3m]" in meta["query"]


def test_series_labels_are_configurable() -> None:
    docs = render({**BOTH_POOLS, "metrics": {"enabled": True, "seriesLabels": {
        "service": "job", "namespace": "kubernetes_namespace"}}})  # fmt: skip
    for scaled in by_kind(docs, "ScaledObject"):
        for trigger in scaled["spec"]["triggers"]:
            query = trigger["metadata"]["query"]
            assert 'kubernetes_namespace="serving"' in query and "job=" in query
            assert "service=" not in query


def test_scale_up_is_bounded_and_scale_down_waits_for_each_drain(
    slo_docs: list[Manifest],
) -> None:
    values = load_values(SLO_VALUES) or {}
    for pool, scaled in scaled_objects(slo_docs).items():
        behavior = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        pod = named(slo_docs, "Deployment", f"rel-pdserve-{pool}")["spec"]["template"]["spec"]
        grace = pod["terminationGracePeriodSeconds"]
        assert grace == values[pool]["drainTimeoutS"] + 30
        (down,) = behavior["scaleDown"]["policies"]
        # One worker at a time, and the next only after the last one's drain could end.
        assert down == {"type": "Pods", "value": 1, "periodSeconds": grace}
        scale_down = values[pool]["autoscaling"].get("scaleDown", {})
        want_window = scale_down.get("stabilizationWindowSeconds", 600)
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] == want_window >= 600
        (up,) = behavior["scaleUp"]["policies"]
        assert up == {"type": "Pods", "value": 2, "periodSeconds": 120}


def test_scale_down_pace_can_be_set_and_stays_within_the_hpa_limit() -> None:
    slow_down = {"stabilizationWindowSeconds": 1200, "pods": 2, "periodSeconds": 300}
    docs = render({
        **BOTH_POOLS,
        "prefill": {"drainTimeoutS": 3000, "autoscaling": {"enabled": True}},
        "decode": {"autoscaling": {"enabled": True, "scaleDown": slow_down}},
    })  # fmt: skip
    objects = scaled_objects(docs)

    def down(pool: str) -> Manifest:
        spec = objects[pool]["spec"]
        return dict(spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"])

    assert down("prefill")["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 1800}]
    assert down("decode") == {
        "stabilizationWindowSeconds": 1200,
        "selectPolicy": "Min",
        "policies": [{"type": "Pods", "value": 2, "periodSeconds": 300}],
    }


def scale_targets(docs: list[Manifest], kind: str) -> list[str]:
    return [str(d["spec"]["scaleTargetRef"]["name"]) for d in by_kind(docs, kind)]


def test_no_other_autoscaler_targets_a_worker_pool(slo_docs: list[Manifest]) -> None:
    docs = render({**BOTH_POOLS, "gateway": {"autoscaling": {"enabled": True}}})
    for case in (slo_docs, docs):
        targets = scale_targets(case, "ScaledObject")
        hpas = scale_targets(case, "HorizontalPodAutoscaler")
        assert len(targets + hpas) == len(set(targets + hpas)), "two autoscalers on one workload"
        assert not {"rel-pdserve-prefill", "rel-pdserve-decode"} & set(hpas)
        assert "rel-pdserve-gateway" not in targets
    assert scale_targets(docs, "HorizontalPodAutoscaler") == ["rel-pdserve-gateway"]


@pytest.mark.parametrize(
    ("values", "error", "match"),
    [
        ({"decode": {"autoscaling": {"enabled": True}}}, "HelmRenderError", "metrics.enabled"),
        ({"metrics": {"enabled": True}, "decode": {"autoscaling": {
            "enabled": True, "minReplicaCount": 5, "maxReplicaCount": 2}}},
         "HelmRenderError", "below minReplicaCount"),
        ({"decode": {"autoscaling": {"minReplicaCount": 0}}}, "HelmValuesError", "minimum"),
        ({"autoscaling": {"prometheus": {"metadata": {"query": "up"}}}},
         "HelmValuesError", "query"),
        ({"autoscaling": {"window": "two minutes"}}, "HelmValuesError", "window"),
        ({"prefill": {"autoscaling": {"scaleDown": {"stabilizationWindowSeconds": 7200}}}},
         "HelmValuesError", "stabilizationWindowSeconds"),
    ],
)  # fmt: skip
def test_impossible_autoscaling_values_are_refused(
    values: dict[str, Any], error: str, match: str
) -> None:
    with pytest.raises(getattr(helm_python, error), match=match):
        render(values)


def test_notes_name_the_scaled_objects_and_the_drain_risk() -> None:
    from services.gateway.config import GatewayConfig

    def decode_draining(seconds: int) -> dict[str, Any]:
        return {"drainTimeoutS": seconds, "autoscaling": {"enabled": True}}

    text = notes({**BOTH_POOLS, "decode": decode_draining(60)})
    assert "decode    1-8 worker(s) (KEDA)" in text
    assert "KEDA ScaledObject rel-pdserve-decode" in text
    # The chart's note assumes the gateway's default request deadline.
    (deadline,) = [f for f in dataclasses.fields(GatewayConfig) if f.name == "request_deadline_s"]
    assert f"({deadline.default:.0f} s, request_deadline_s)" in text
    longer = notes({**BOTH_POOLS, "decode": decode_draining(900)})
    assert "request_deadline_s" not in longer


@promtool.needs_promtool
def test_trigger_queries_parse_and_evaluate_as_intended(
    slo_docs: list[Manifest], tmp_path: Path
) -> None:
    """0 without traffic, the p90 with traffic, no value when the series are gone."""
    objects = scaled_objects(slo_docs)
    queries = {f"keda:{pool}:{name}".replace("-", "_"): t["metadata"]["query"]
               for pool, so in objects.items() for name, t in triggers(so).items()}  # fmt: skip
    promtool.check_rules(promtool.records(queries), tmp_path)

    gw = 'namespace="serving",service="rel-pdserve-gateway"'
    prefill = 'namespace="serving",service="rel-pdserve-prefill"'
    decode = 'namespace="serving",service="rel-pdserve-decode"'
    ttft = triggers(objects["prefill"])["ttft-p90"]["metadata"]["query"]
    itl = triggers(objects["decode"])["itl-p90"]["metadata"]["query"]
    # TTFT: every request between 1 s and 2.5 s -> p90 interpolates to 1 + 0.9 x 1.5.
    # ITL: the gateway is up but idle -> 0 (histogram_quantile alone gives NaN).
    series = [
        (f'pdserve_time_to_first_token_seconds_bucket{{{gw},le="1.0"}}', "0x20"),
        (f'pdserve_time_to_first_token_seconds_bucket{{{gw},le="2.5"}}', "0+10x20"),
        (f'pdserve_time_to_first_token_seconds_bucket{{{gw},le="+Inf"}}', "0+10x20"),
        (f"pdserve_time_to_first_token_seconds_count{{{gw}}}", "0+10x20"),
        (f'pdserve_inter_token_latency_seconds_bucket{{{gw},le="0.1"}}', "0x20"),
        (f'pdserve_inter_token_latency_seconds_bucket{{{gw},le="+Inf"}}', "0x20"),
        (f"pdserve_inter_token_latency_seconds_count{{{gw}}}", "0x20"),
        (f'pdserve_num_prompt_tokens_waiting{{{prefill},pod="a"}}', "3x20"),
        (f'pdserve_num_prompt_tokens_waiting{{{prefill},pod="b"}}', "5x20"),
        (f'pdserve_kv_blocks{{{decode},pod="a",state="used"}}', "30x20"),
        (f'pdserve_kv_blocks{{{decode},pod="a",state="total"}}', "100x20"),
        (f'pdserve_kv_blocks{{{decode},pod="b",state="used"}}', "90x20"),
        (f'pdserve_kv_blocks{{{decode},pod="b",state="total"}}', "100x20"),
    ]
    gone = ttft.replace("rel-pdserve-gateway", "another-release-gateway")
    expect = [
        (ttft, 2.35),
        (itl, 0),
        (triggers(objects["prefill"])["queued-prompt-tokens"]["metadata"]["query"], 8),
        (triggers(objects["decode"])["kv-utilization"]["metadata"]["query"], 0.6),
        (gone, None),
    ]
    case = {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series],
        "promql_expr_test": [
            {"expr": expr, "eval_time": "10m",
             "exp_samples": [] if value is None else [{"labels": "{}", "value": value}]}
            for expr, value in expect
        ],
    }  # fmt: skip
    promtool.run_rule_tests([], [case], tmp_path)

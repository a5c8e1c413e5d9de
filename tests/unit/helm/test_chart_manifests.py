"""The Helm chart renders, lints clean, and every manifest is valid Kubernetes.

Rendered with the real Helm engine for the defaults and every value set under
helm/pdserve/ci/ (CPU-only dev, multi-node GPU, external Redis with TLS, mixed workers
with an init-container model, SLO autoscaling and alerts); validated against the newest
Kubernetes schema that `kubernetes-validate` ships, in strict mode (unknown fields are
errors), and custom resources (KEDA, Prometheus Operator) against their CRDs' schemas
(crd_schemas.py).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from services.router.redis_client import SentinelUrl
from tests.unit.helm import crd_schemas
from tests.unit.helm.chart import (
    CHART,
    VALUE_SETS,
    Manifest,
    by_kind,
    component,
    container_env,
    containers,
    is_pdserve,
    load_values,
    named,
    notes,
    pod_templates,
    render,
)

helm_python = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

CASES: list[Path | None] = [None, *VALUE_SETS]
IDS = ["defaults", *(p.name.removesuffix("-values.yaml") for p in VALUE_SETS)]
GPU = "nvidia.com/gpu"


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def case(request: pytest.FixtureRequest) -> tuple[dict[str, Any] | None, list[Manifest]]:
    values = load_values(request.param)
    return values, render(values)


def test_value_sets_cover_the_required_deployments() -> None:
    names = {p.name for p in VALUE_SETS}
    assert {"cpu-dev-values.yaml", "multinode-gpu-values.yaml",
            "external-redis-tls-values.yaml", "sentinel-redis-values.yaml"} <= names  # fmt: skip


@pytest.mark.parametrize("values_file", CASES, ids=IDS)
def test_lint_has_no_errors_or_warnings(values_file: Path | None) -> None:
    report = helm_python.lint(str(CHART), load_values(values_file), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_every_manifest_is_valid_kubernetes(case: tuple[Any, list[Manifest]]) -> None:
    _, docs = case
    version = kubernetes_validate.latest_version()
    for doc in docs:
        if doc["kind"] in crd_schemas.SCHEMAS:
            # A custom resource: its CRD's schema (crd_schemas.py), and ObjectMeta's own.
            crd_schemas.validate(doc)
            meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}
            kubernetes_validate.validate(meta, version, strict=True)
            continue
        kubernetes_validate.validate(doc, version, strict=True)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds


def test_value_sets_cover_every_custom_resource() -> None:
    """Some value set renders each custom resource kind, so the test above checks it."""
    rendered = {d["kind"] for p in VALUE_SETS for d in render(load_values(p))}
    assert set(crd_schemas.SCHEMAS) <= rendered


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "triggers", 0, "metricTyp"), "Value"),  # a misspelt field
        (("spec", "minReplicaCount"), "2"),  # a string for an int32
        (("spec", "triggers", 0, "metadata", "threshold"), 0.5),  # metadata is string -> string
        (("spec", "advanced", "horizontalPodAutoscalerConfig", "behavior", "scaleDown",
          "stabilizationWindowSeconds"), 7200),  # over the HPA's 3600 s
        (("spec", "minReplicaCount"), 101),  # over the default maximum (the CRD's CEL rule)
        (("spec", "pollingInterval"), 2**31),  # int32 in the CRD (format int32)
    ],
)  # fmt: skip
def test_custom_resource_schemas_refuse_what_the_api_would(
    path: tuple[str | int, ...], value: Any
) -> None:
    docs = render(load_values(CHART / "ci" / "slo-autoscaling-values.yaml"))
    doc = copy.deepcopy(by_kind(docs, "ScaledObject")[0])
    crd_schemas.validate(doc)
    node: Any = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        crd_schemas.validate(doc)


def test_a_recording_rule_cannot_have_alert_fields() -> None:
    docs = render(load_values(CHART / "ci" / "slo-autoscaling-values.yaml"))
    (rule,) = by_kind(docs, "PrometheusRule")
    rule = copy.deepcopy(rule)
    rule["spec"]["groups"][0]["rules"][0]["for"] = "5m"
    with pytest.raises(jsonschema.ValidationError):
        crd_schemas.validate(rule)


def test_gpus_are_requested_only_by_prefill_and_decode(case: tuple[Any, list[Manifest]]) -> None:
    values, docs = case
    pools = values or {}
    for workload, pod in pod_templates(docs):
        name = component(workload)
        for c in containers(pod):
            res = c.get("resources", {})
            has_gpu = GPU in res.get("limits", {}) or GPU in res.get("requests", {})
            is_worker = name in ("prefill", "decode") and c in pod["containers"]
            gpus = pools.get(name, {}).get("gpus", 1) if is_worker else 0
            if gpus:
                assert res["limits"][GPU] == res["requests"][GPU] == gpus
            else:
                assert not has_gpu, f"{workload['metadata']['name']}/{c['name']} asks for a GPU"


def test_every_container_has_readiness_and_liveness_probes(
    case: tuple[Any, list[Manifest]],
) -> None:
    _, docs = case
    seen = 0
    for workload, pod in pod_templates(docs):
        for c in pod["containers"]:
            seen += 1
            assert "readinessProbe" in c and "livenessProbe" in c, c["name"]
            if not is_pdserve(c):
                continue
            ports = {p["containerPort"] for p in c["ports"] if p["name"] == "grpc"}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                # Kubernetes' native gRPC probe on the standard health service.
                assert c[probe]["grpc"]["port"] in ports, (workload["metadata"]["name"], probe)
            assert _served_port(docs, c) in ports
    assert seen >= 3


def _served_port(docs: list[Manifest], c: Manifest) -> int:
    """The port the service itself binds, from its flags or env (not from the manifest)."""
    args, env = c["args"], container_env(docs, c)
    if "--router-port" in args:
        return int(args[args.index("--router-port") + 1])
    return int(env.get("PDSERVE_GATEWAY_PORT") or env["PDSERVE_PORT"])


def test_every_component_has_a_pdb_selecting_its_pods(case: tuple[Any, list[Manifest]]) -> None:
    values, docs = case
    pdbs = {component(p): p for p in by_kind(docs, "PodDisruptionBudget")}
    expected = {"gateway", "router", "decode"}
    if ((values or {}).get("prefill") or {}).get("enabled", True):
        expected.add("prefill")
    assert set(pdbs) == expected
    for workload in by_kind(docs, "Deployment"):
        selector = pdbs[component(workload)]["spec"]["selector"]["matchLabels"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()


def test_router_runs_at_least_two_replicas_and_the_schema_refuses_one() -> None:
    docs = render(None)
    assert named(docs, "Deployment", "rel-pdserve-router")["spec"]["replicas"] >= 2
    with pytest.raises(helm_python.HelmValuesError, match="router/replicas"):
        render({"router": {"replicas": 1}})


def test_pools_scale_independently() -> None:
    docs = render({"prefill": {"replicas": 3}, "decode": {"replicas": 7, "gpus": 2}})
    assert named(docs, "Deployment", "rel-pdserve-prefill")["spec"]["replicas"] == 3
    decode = named(docs, "Deployment", "rel-pdserve-decode")
    assert decode["spec"]["replicas"] == 7
    assert decode["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][GPU] == 2


def test_workers_get_shm_ucx_and_rdma_settings() -> None:
    docs = render(load_values(CHART / "ci" / "multinode-gpu-values.yaml"))
    for pool in ("prefill", "decode"):
        pod = named(docs, "Deployment", f"rel-pdserve-{pool}")["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        env = container_env(docs, c)
        assert env["UCX_TLS"] == "rc,cuda_copy,cuda_ipc" and env["UCX_NET_DEVICES"]
        assert env["PDSERVE_HOST"] == env["PDSERVE_KV_TRANSFER_HOST"] == "10.1.2.3"
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        assert c["resources"]["limits"]["hugepages-2Mi"] == "4Gi"
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
    gateway = named(docs, "Deployment", "rel-pdserve-gateway")["spec"]["template"]["spec"]
    assert "/dev/shm" not in {m["mountPath"] for m in gateway["containers"][0]["volumeMounts"]}


def test_builtin_redis_is_a_statefulset_the_services_point_at() -> None:
    docs = render(None)
    sts = named(docs, "StatefulSet", "rel-pdserve-redis")
    svc = named(docs, "Service", "rel-pdserve-redis")
    assert sts["spec"]["template"]["metadata"]["labels"].items() >= svc["spec"]["selector"].items()
    for _, pod in pod_templates(docs):
        for c in filter(is_pdserve, pod["containers"]):
            assert container_env(docs, c)["PDSERVE_REDIS_URL"] == "redis://rel-pdserve-redis:6379/0"


def test_sentinel_redis_is_two_servers_and_three_sentinels_found_by_name() -> None:
    docs = render(load_values(CHART / "ci" / "sentinel-redis-values.yaml"))
    servers = named(docs, "StatefulSet", "rel-pdserve-redis-ha")
    sentinels = named(docs, "StatefulSet", "rel-pdserve-sentinel")
    assert (servers["spec"]["replicas"], sentinels["spec"]["replicas"]) == (2, 3)
    for sts in (servers, sentinels):
        name = sts["metadata"]["name"]
        svc = named(docs, "Service", name)
        assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == name
    expected = tuple((f"rel-pdserve-sentinel-{i}.rel-pdserve-sentinel", 26379) for i in range(3))
    for _, pod in pod_templates(docs):
        for c in filter(is_pdserve, pod["containers"]):
            url = SentinelUrl.parse(container_env(docs, c)["PDSERVE_REDIS_URL"])
            assert (url.sentinels, url.service) == (expected, "pdserve")
    scripts = named(docs, "ConfigMap", "rel-pdserve-redis-ha-scripts")["data"]
    assert "sentinel monitor pdserve ${primary} 6379 2" in scripts["start-sentinel.sh"]
    assert '--replica-announce-ip "$me"' in scripts["start-redis.sh"]
    assert not [d for d in docs if d["kind"] == "Secret" and "redis" in d["metadata"]["name"]]


def test_external_tls_redis_comes_from_a_secret_with_its_ca_mounted() -> None:
    docs = render(load_values(CHART / "ci" / "external-redis-tls-values.yaml"))
    assert not by_kind(docs, "StatefulSet")
    for _, pod in pod_templates(docs):
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in filter(is_pdserve, pod["containers"]):
            (url_env,) = [e for e in c["env"] if e["name"] == "PDSERVE_REDIS_URL"]
            assert url_env["valueFrom"]["secretKeyRef"] == {"name": "pdserve-redis", "key": "url"}
            mount = next(m for m in c["volumeMounts"] if m["name"] == "redis-tls")
            assert mount["mountPath"] == "/etc/pdserve/redis-tls"
            assert volumes["redis-tls"]["secret"]["secretName"] == "redis-ca"


def test_external_url_is_stored_in_a_chart_secret() -> None:
    docs = render(load_values(CHART / "ci" / "mixed-init-model-values.yaml"))
    secret = named(docs, "Secret", "rel-pdserve-redis-url")
    assert secret["stringData"]["redis-url"] == "redis://redis.shared.svc:6379/3"
    assert not [d for d in by_kind(docs, "Deployment") if component(d) == "prefill"]
    decode = named(docs, "Deployment", "rel-pdserve-decode")["spec"]["template"]["spec"]
    (init,) = decode["initContainers"]
    assert init["env"][0] == {"name": "MODEL_DIR", "value": "/models/SmolLM2-135M-Instruct"}
    env = container_env(docs, decode["containers"][0])
    assert env["PDSERVE_ROLE"] == "mixed" and env["PDSERVE_MODEL"] == init["env"][0]["value"]


@pytest.mark.parametrize(
    ("values", "volume_key"),
    [
        ({"model": {"source": "pvc", "path": "m", "pvc": {"claimName": "w"}}},
         "persistentVolumeClaim"),
        ({"model": {"source": "hostPath", "path": "m", "hostPath": {"path": "/srv"}}},
         "hostPath"),
    ],
)  # fmt: skip
def test_model_volume_is_mounted_in_gateway_and_workers(
    values: dict[str, Any], volume_key: str
) -> None:
    docs = render(values)
    for name in ("gateway", "prefill", "decode"):
        pod = named(docs, "Deployment", f"rel-pdserve-{name}")["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == "model")
        assert volume_key in volume
        c = pod["containers"][0]
        assert container_env(docs, c)["PDSERVE_MODEL"] == "/models/m"
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]


def test_monitoring_hpa_and_http_are_optional() -> None:
    default = render(None)
    assert not by_kind(default, "ServiceMonitor")
    assert not by_kind(default, "HorizontalPodAutoscaler")
    docs = render(load_values(CHART / "ci" / "multinode-gpu-values.yaml"))
    (monitor,) = by_kind(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    scraped = [s for s in by_kind(docs, "Service")
               if "metrics" in {p["name"] for p in s["spec"]["ports"]}]  # fmt: skip
    assert {component(s) for s in scraped} == {"gateway", "router", "prefill", "decode"}
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "rel-pdserve-gateway"
    assert "replicas" not in named(docs, "Deployment", "rel-pdserve-gateway")["spec"]
    gateway_svc = named(docs, "Service", "rel-pdserve-gateway")
    assert {p["name"] for p in gateway_svc["spec"]["ports"]} >= {"grpc", "http"}
    gateway = named(docs, "Deployment", "rel-pdserve-gateway")["spec"]["template"]["spec"]
    (c,) = gateway["containers"]
    http = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
    assert container_env(docs, c)["PDSERVE_HTTP_PORT"] == str(http)


def test_topology_spread_defaults_to_the_pools_own_pods() -> None:
    docs = render(load_values(CHART / "ci" / "multinode-gpu-values.yaml"))
    pod = named(docs, "Deployment", "rel-pdserve-prefill")["spec"]["template"]["spec"]
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "prefill"


def test_notes_explain_how_to_reach_and_scale() -> None:
    text = notes(None)
    assert "port-forward svc/rel-pdserve-gateway 8470:8470" in text
    assert "deployment/rel-pdserve-decode" in text and "deployment/rel-pdserve-prefill" in text


def test_the_crds_are_the_pinned_files_with_every_cel_rule_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert crd_schemas.SCHEMAS["ScaledObject"]["properties"]["apiVersion"] == {
        "const": "keda.sh/v1alpha1"
    }
    for pin in crd_schemas.PINNED.values():
        (tmp_path / pin.file).write_bytes((crd_schemas.CRDS / pin.file).read_bytes())
    monkeypatch.setattr(crd_schemas, "CRDS", tmp_path)
    crd_schemas.load("ServiceMonitor")
    edited = tmp_path / crd_schemas.PINNED["ServiceMonitor"].file
    edited.write_text(edited.read_text() + "\n")
    with pytest.raises(ValueError, match="not the pinned file"):
        crd_schemas.load("ServiceMonitor")
    monkeypatch.setattr(crd_schemas, "CHECKS", ())  # as if a new CEL rule had appeared
    with pytest.raises(ValueError, match="CEL rules without a check"):
        crd_schemas.load("ScaledObject")

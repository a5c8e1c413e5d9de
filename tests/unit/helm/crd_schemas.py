"""Schemas for the custom resources the chart renders, which `kubernetes-validate` has
no schema for: KEDA's ScaledObject (keda.sh/v1alpha1) and the Prometheus Operator's
ServiceMonitor and PrometheusRule (monitoring.coreos.com/v1).

Each schema is the OpenAPI schema of the project's own CRD, pinned by release and
digest (crds/README.md), made strict: `additionalProperties: false` on every object
that lists its properties and does not preserve unknown fields, so a misspelt or
misplaced field fails here, where the API server would prune it without a word (or
reject it only under strict field validation). What the API server and the controllers
check beyond the OpenAPI schema is added as `Check`s: the CRD's CEL rules (each one
present must have a check here, or loading fails), the HPA's limit on the stabilization
window (Kubernetes validates the HPA that KEDA creates), and Prometheus' rule-file
format (a recording rule has no alert fields; the Operator's admission webhook runs it).
`metadata` is checked with the Kubernetes ObjectMeta schema itself, by the caller.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

Schema = dict[str, Any]
Doc = dict[str, Any]
CRDS = Path(__file__).resolve().parent / "crds"


@dataclass(frozen=True)
class Pinned:
    file: str
    sha256: str
    version: str  # the served version the chart renders


PINNED: dict[str, Pinned] = {
    "ScaledObject": Pinned(
        "keda.sh_scaledobjects.yaml",
        "af35555862a83933b074af14ad439c4b4ceabaf4daa3e9338e9b23e36d308d80",
        "v1alpha1",
    ),
    "PrometheusRule": Pinned(
        "monitoring.coreos.com_prometheusrules.yaml",
        "78be98554b9c8506ab2b4f4feb91c5f3a56e536a0a510f3a8e876a459970d56d",
        "v1",
    ),
    "ServiceMonitor": Pinned(
        "monitoring.coreos.com_servicemonitors.yaml",
        "a99047972c9dd7679ce2050b9968e8a08773492e671b3e17abd476d42aa78a32",
        "v1",
    ),
}


def strict(node: Any) -> Any:
    """A copy of an OpenAPI schema node as a JSON schema that refuses unknown fields, bounds
    int32 and reads Kubernetes' int-or-string."""
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items()}
    if out.get("format") == "int32":  # the API server checks the range of the format
        out.setdefault("minimum", -(2**31))
        out.setdefault("maximum", 2**31 - 1)
    if out.get("x-kubernetes-int-or-string") and "type" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    listed = out.get("type") == "object" and "properties" in out
    open_ended = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if listed and not open_ended:
        out["additionalProperties"] = False
    return out


def _cel_rules(node: Any) -> Iterator[str]:
    if isinstance(node, list):
        for n in node:
            yield from _cel_rules(n)
    elif isinstance(node, dict):
        for rule in node.get("x-kubernetes-validations", []):
            yield rule["rule"]
        for value in node.values():
            yield from _cel_rules(value)


@dataclass(frozen=True)
class Check:
    """A rule the API server or a controller applies beyond the OpenAPI schema."""

    kind: str
    why: str
    holds: Callable[[Doc], bool]
    cel: str | None = None  # the CRD's CEL rule this check stands for, verbatim


_MAX_REPLICAS_DEFAULT = 100  # KEDA's, which its CEL rule assumes


def _replicas_ordered(doc: Doc) -> bool:
    spec = doc.get("spec", {})
    top = spec.get("maxReplicaCount", _MAX_REPLICAS_DEFAULT)
    return "minReplicaCount" not in spec or spec["minReplicaCount"] <= top


def _windows(doc: Doc) -> Iterator[int]:
    behavior = (
        doc.get("spec", {})
        .get("advanced", {})
        .get("horizontalPodAutoscalerConfig", {})
        .get("behavior", {})
    )
    for direction in ("scaleUp", "scaleDown"):
        if "stabilizationWindowSeconds" in behavior.get(direction, {}):
            yield behavior[direction]["stabilizationWindowSeconds"]


_ALERT_ONLY = ("alert", "for", "keep_firing_for", "annotations")


def _rules_well_formed(doc: Doc) -> bool:
    for group in doc.get("spec", {}).get("groups", []):
        for rule in group.get("rules", []):
            if ("record" in rule) == ("alert" in rule):
                return False  # a rule records or alerts, one of the two
            if "record" in rule and any(k in rule for k in _ALERT_ONLY):
                return False
    return True


CHECKS = (
    Check(
        "ScaledObject",
        "minReplicaCount must be less than or equal to maxReplicaCount",
        _replicas_ordered,
        cel="!has(self.minReplicaCount) || self.minReplicaCount <= (has(self.maxReplicaCount)"
        " ? self.maxReplicaCount : 100)",
    ),
    Check(
        "ScaledObject",
        "the HPA's stabilizationWindowSeconds must be 0 to 3600",
        lambda doc: all(0 <= w <= 3600 for w in _windows(doc)),
    ),
    Check(
        "PrometheusRule",
        "a rule either records (with no alert fields) or alerts",
        _rules_well_formed,
    ),
)


def load(kind: str) -> Schema:
    """The strict schema of `kind` from its pinned CRD; ValueError if the file is not
    the pinned one or has a CEL rule no `Check` stands for."""
    pin = PINNED[kind]
    raw = (CRDS / pin.file).read_bytes()
    if hashlib.sha256(raw).hexdigest() != pin.sha256:
        raise ValueError(f"{pin.file} is not the pinned file (crds/README.md)")
    crd = yaml.safe_load(raw)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == pin.version]
    schema = version["schema"]["openAPIV3Schema"]
    covered = {c.cel for c in CHECKS if c.kind == kind}
    unchecked = set(_cel_rules(schema)) - covered
    if unchecked:
        raise ValueError(f"{pin.file}: CEL rules without a check here: {sorted(unchecked)}")
    out: Schema = strict(copy.deepcopy(schema))
    out["properties"]["apiVersion"] = {"const": f"{crd['spec']['group']}/{pin.version}"}
    out["properties"]["kind"] = {"const": crd["spec"]["names"]["kind"]}
    out["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return out


SCHEMAS: dict[str, Schema] = {kind: load(kind) for kind in PINNED}


def validate(doc: Doc) -> None:
    """Raise `jsonschema.ValidationError` unless `doc` fits its kind's CRD schema and
    the checks beyond it."""
    jsonschema.Draft7Validator(SCHEMAS[doc["kind"]]).validate(doc)
    for check in CHECKS:
        if check.kind == doc["kind"] and not check.holds(doc):
            raise jsonschema.ValidationError(f"{doc['kind']}: {check.why}")

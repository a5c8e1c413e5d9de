"""Strict schemas for the custom resources the chart renders, which `kubernetes-validate`
has no schema for: KEDA's ScaledObject (keda.sh/v1alpha1) and the Prometheus Operator's
ServiceMonitor and PrometheusRule (monitoring.coreos.com/v1).

Each schema is the part of its CRD's OpenAPI schema that the chart can produce, written
from the projects' API references (KEDA 2.x `ScaledObjectSpec`, Kubernetes'
`HorizontalPodAutoscalerBehavior`, prometheus-operator's `monitoring/v1` types): the
same field names, types, required fields and limits, and `additionalProperties: false`
everywhere, so a misspelt or misplaced field fails here as the API server (which prunes
unknown fields, or rejects them under strict field validation) would not tell. A field the
chart starts to use must be added here from the CRD. `metadata` is checked with the
Kubernetes ObjectMeta schema itself.
"""

from __future__ import annotations

from typing import Any

import jsonschema

Schema = dict[str, Any]

INT32: Schema = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
STRING_MAP: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
#: Prometheus' duration grammar, as the Operator's `Duration` type validates it.
DURATION: Schema = {
    "type": "string",
    "pattern": r"^(0|([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?)$",
}


def _object(properties: Schema, required: tuple[str, ...] = ()) -> Schema:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


# autoscaling/v2 HPAScalingRules, which KEDA embeds in advanced.horizontalPodAutoscalerConfig.
_HPA_POLICY = _object(
    {
        "type": {"enum": ["Pods", "Percent"]},
        "value": {"type": "integer", "exclusiveMinimum": 0},
        "periodSeconds": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1800},
    },
    ("type", "value", "periodSeconds"),
)
_HPA_RULES = _object(
    {
        "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
        "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
        "policies": {"type": "array", "items": _HPA_POLICY},
    }
)

SCALED_OBJECT: Schema = _object(
    {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object"},
        "spec": _object(
            {
                "scaleTargetRef": _object(
                    {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string", "minLength": 1},
                        "envSourceContainerName": {"type": "string"},
                    },
                    ("name",),
                ),
                "pollingInterval": INT32,
                "cooldownPeriod": INT32,
                "initialCooldownPeriod": INT32,
                "idleReplicaCount": INT32,
                "minReplicaCount": INT32,
                "maxReplicaCount": INT32,
                "advanced": _object(
                    {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": _object(
                            {
                                "name": {"type": "string"},
                                "behavior": _object(
                                    {"scaleUp": _HPA_RULES, "scaleDown": _HPA_RULES}
                                ),
                            }
                        ),
                    }
                ),
                "fallback": _object(
                    {"failureThreshold": INT32, "replicas": INT32},
                    ("failureThreshold", "replicas"),
                ),
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": _object(
                        {
                            "type": {"type": "string", "minLength": 1},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "metadata": STRING_MAP,
                            "authenticationRef": _object(
                                {
                                    "name": {"type": "string", "minLength": 1},
                                    "kind": {
                                        "enum": [
                                            "TriggerAuthentication",
                                            "ClusterTriggerAuthentication",
                                        ]
                                    },
                                },
                                ("name",),
                            ),
                        },
                        ("type", "metadata"),
                    ),
                },
            },
            ("scaleTargetRef", "triggers"),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)

_RULE = {
    **_object(
        {
            "record": {"type": "string", "pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
            "alert": {"type": "string", "minLength": 1},
            "expr": {"type": ["string", "integer"], "minLength": 1},
            "for": DURATION,
            "keep_firing_for": DURATION,
            "labels": STRING_MAP,
            "annotations": STRING_MAP,
        },
        ("expr",),
    ),
    # A rule records or alerts, never both; only alerts have `for` and annotations.
    "oneOf": [
        {"required": ["record"], "not": {"anyOf": [{"required": [k]} for k in ("alert", "for",
                                                  "keep_firing_for", "annotations")]}},
        {"required": ["alert"], "not": {"required": ["record"]}},
    ],
}  # fmt: skip

PROMETHEUS_RULE: Schema = _object(
    {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {"type": "object"},
        "spec": _object(
            {
                "groups": {
                    "type": "array",
                    "items": _object(
                        {
                            "name": {"type": "string", "minLength": 1},
                            "interval": DURATION,
                            "query_offset": DURATION,
                            "limit": {"type": "integer", "minimum": 0},
                            "labels": STRING_MAP,
                            "rules": {"type": "array", "items": _RULE},
                        },
                        ("name",),
                    ),
                }
            }
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)

_LABEL_SELECTOR = _object(
    {
        "matchLabels": STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": _object(
                {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
                ("key", "operator"),
            ),
        },
    }
)

SERVICE_MONITOR: Schema = _object(
    {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object"},
        "spec": _object(
            {
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": _object(
                    {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    }
                ),
                "jobLabel": {"type": "string"},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "endpoints": {
                    "type": "array",
                    "items": _object(
                        {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": DURATION,
                            "scrapeTimeout": DURATION,
                            "honorLabels": {"type": "boolean"},
                        }
                    ),
                },
            },
            ("selector",),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)

SCHEMAS: dict[str, Schema] = {
    "ScaledObject": SCALED_OBJECT,
    "PrometheusRule": PROMETHEUS_RULE,
    "ServiceMonitor": SERVICE_MONITOR,
}


def validate(doc: dict[str, Any]) -> None:
    """Raise `jsonschema.ValidationError` unless `doc` fits its kind's CRD schema."""
    jsonschema.Draft7Validator(SCHEMAS[doc["kind"]]).validate(doc)

"""The metric names a PromQL expression reads, and the metric names pdserve exports.

`metric_names(expr)` strips what is not a series name (strings, label matchers, range and
grouping clauses, numbers, Grafana variables) and keeps the identifiers that are neither
functions nor keywords, so a typo in a metric name inside a query comes out as a name the
services never export. `exported_series()` builds every role's metric set with the
services' own classes on fresh registries and lists the series names Prometheus would
store (counters gain `_total`, histograms `_bucket`/`_sum`/`_count`), so the answer
follows the code, including names built at run time such as `pdserve_router_*`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

REPO = Path(__file__).resolve().parents[3]

#: PromQL's functions and aggregation operators (prometheus.io/docs/prometheus/latest/querying).
FUNCTIONS = frozenset({
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh",
    "avg", "avg_over_time", "bottomk", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "cos", "cosh", "count", "count_over_time", "count_values", "day_of_month", "day_of_week",
    "day_of_year", "days_in_month", "deg", "delta", "deriv", "exp", "floor", "group",
    "histogram_avg", "histogram_count", "histogram_fraction", "histogram_quantile",
    "histogram_stddev", "histogram_stdvar", "histogram_sum", "holt_winters", "hour", "idelta",
    "increase", "irate", "label_join", "label_replace", "last_over_time", "limit_ratio",
    "limitk", "ln", "log10", "log2", "mad_over_time", "max", "max_over_time", "min",
    "min_over_time", "minute", "month", "pi", "predict_linear", "present_over_time",
    "quantile", "quantile_over_time", "rad", "rate", "resets", "round", "scalar", "sgn", "sin",
    "sinh", "sort", "sort_by_label", "sort_by_label_desc", "sort_desc", "sqrt", "stddev",
    "stddev_over_time", "stdvar", "stdvar_over_time", "sum", "sum_over_time", "tan", "tanh",
    "time", "timestamp", "topk", "vector", "year"
})  # fmt: skip
KEYWORDS = frozenset({
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "offset", "inf", "nan"
})  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_OFFSET = re.compile(r"\boffset\s+-?\w+")
_VARIABLE = re.compile(r"\$\{?\w+(?::\w+)?\}?")
_NUMBER = re.compile(r"(?<![\w:])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _skeleton(expr: str) -> str:
    text = _VARIABLE.sub(" ", _STRING.sub('""', expr))
    for pattern in (_GROUPING, _MATCHERS, _RANGE, _OFFSET):
        text = pattern.sub(" ", text)
    return _NUMBER.sub(" ", text)


def functions_called(expr: str) -> set[str]:
    """Every identifier followed by `(` (a function or an aggregation), keywords aside."""
    return set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*\(", _skeleton(expr))) - KEYWORDS


def metric_names(expr: str) -> set[str]:
    """The series names `expr` selects (a bare identifier that is not called)."""
    text = _skeleton(expr)
    names = set()
    for match in _IDENT.finditer(text):
        rest = text[match.end() :].lstrip()
        if rest.startswith("("):
            continue
        if match.group() not in KEYWORDS:
            names.add(match.group())
    return names


def _series(family_name: str, kind: str) -> set[str]:
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
        "summary": ("", "_sum", "_count", "_created"),
        "info": ("_info",),
    }.get(kind, ("",))
    return {family_name + s for s in suffixes}


def _families(registry: CollectorRegistry) -> dict[str, str]:
    return {family.name: family.type for family in registry.collect()}


def exported_families() -> dict[str, dict[str, str]]:
    """{role: {family name: type}} for each role's `/metrics`: gateway, worker, router
    (registered as the services do: services/gateway/stream/telemetry.py and server.py,
    services/engine_host/telemetry.py, the router service)."""
    from engine.stats import EngineStats
    from services.common.telemetry import node_cost_gauge
    from services.engine_host.metrics import EngineCollector, WorkerMetrics
    from services.gateway.access.usage_ledger import LedgerCollector, LedgerCounts
    from services.gateway.flow.admission_metrics import AdmissionMetrics
    from services.gateway.stream.metrics import GatewayMetrics
    from services.gateway.stream.record_book import HeldCollector, RecordBook
    from services.router.metrics import RouterCollector
    from services.router.router import RouterStats

    required: dict[str, Any] = {
        f.name: 0
        for f in dataclasses.fields(EngineStats)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    stats = EngineStats(**required)

    gateway = CollectorRegistry()
    GatewayMetrics(gateway, slo_ttft_s=1.0, slo_itl_s=0.1)
    AdmissionMetrics(gateway)
    gateway.register(HeldCollector(RecordBook[object]()))
    gateway.register(RouterCollector(RouterStats))
    gateway.register(LedgerCollector(lambda: LedgerCounts(0, 0, 0)))
    worker = CollectorRegistry()
    WorkerMetrics(worker)
    worker.register(EngineCollector(lambda: stats))
    router = CollectorRegistry()
    router.register(RouterCollector(RouterStats))
    for registry in (gateway, worker, router):  # Telemetry.start registers it everywhere
        node_cost_gauge(registry)
    return {"gateway": _families(gateway), "worker": _families(worker), "router": _families(router)}


def exported_series() -> dict[str, set[str]]:
    """{role: the series names Prometheus stores from that role's `/metrics`}."""
    return {
        role: {n for name, kind in families.items() for n in _series(name, kind)}
        for role, families in exported_families().items()
    }


def all_exported() -> set[str]:
    return set().union(*exported_series().values())


_METRIC_LITERAL = re.compile(r"""["'](pdserve_[a-z0-9_]+)["']""")


def metric_literals_in_source() -> dict[str, str]:
    """`"pdserve_..."` literals in the services' modules that use prometheus_client, as
    {family name: file} (a `_total` suffix dropped, as prometheus_client does)."""
    found: dict[str, str] = {}
    for path in sorted((REPO / "services").rglob("*.py")):
        text = path.read_text()
        if "prometheus_client" not in text:
            continue
        for name in _METRIC_LITERAL.findall(text):
            found[name.removesuffix("_total")] = str(path.relative_to(REPO))
    return found

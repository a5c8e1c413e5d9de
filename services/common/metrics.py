"""Prometheus metrics of one service process and their `/metrics` HTTP endpoint.

Lifecycle: a service makes one `CollectorRegistry` (never the library's global one, so
tests and several services in one process never share counters), builds its role's
metric set on it (the gateway's `services.gateway.stream.metrics.GatewayMetrics`, a
worker's `services.engine_host.metrics.WorkerMetrics`, plus scrape-time collectors over
state that already exists: `EngineCollector` reads the engine's stats; the router's
`services.router.metrics.RouterCollector` its counters), and starts `MetricsServer` on
the configured port, whose bound port goes into the service's JSON ready line. Request
paths only observe histograms and bump counters (a few microseconds); gauges derived
from engine state cost nothing until a scrape. `close()` stops the HTTP server.

Names (all prefixed `pdserve_`): see docs/observability.md.
"""

from __future__ import annotations

import urllib.request
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families


class MetricsServer:
    """`/metrics` over HTTP for one registry, on its own daemon thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._server: WSGIServer | None
        self._server, _ = start_http_server(port, addr=host, registry=registry)
        self.port: int = self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def family_samples(page: dict[str, float], name: str) -> list[float]:
    """A `scrape`d family's samples, one per label set (`name` alone or `name{...}`)."""
    return [v for k, v in page.items() if k == name or k.startswith(name + "{")]


def family_total(page: dict[str, float], name: str) -> float | None:
    """The sum of a `scrape`d family's samples over every label set, None where the
    page has none of them."""
    values = family_samples(page, name)
    return sum(values) if values else None


def scrape(port: int, host: str = "127.0.0.1", timeout_s: float = 5.0) -> dict[str, float]:
    """One `/metrics` page as {"name{label=value,...}": value} (labels sorted)."""
    url = f"http://{host}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        text = resp.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values

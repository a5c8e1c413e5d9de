"""A service process's telemetry handles: log format, tracer, metrics registry and endpoint.

Lifecycle: `Telemetry.start(config, service_name, worker_id)` runs once when a service
starts: it applies the log format, builds the tracer (`Tracing`, a no-op unless an
exporter is configured), makes the process's own `CollectorRegistry`, and serves it on
`/metrics` unless `metrics_port` is negative. The service then registers its role's
metrics on `registry`, adds `ready_fields()` to its JSON ready line, and on shutdown
calls `close()`, which stops the HTTP endpoint and flushes queued spans.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from services.common.log_format import configure_logging
from services.common.metrics import MetricsServer
from services.common.telemetry_config import TelemetryConfig
from services.common.tracing import Tracing


@dataclass
class Telemetry:
    config: TelemetryConfig
    tracing: Tracing
    registry: CollectorRegistry
    server: MetricsServer | None = None

    @classmethod
    def start(cls, config: TelemetryConfig, service_name: str, worker_id: str = "") -> Telemetry:
        configure_logging(config.log_format)
        tracing = Tracing.from_config(config, service_name, worker_id)
        registry = CollectorRegistry(auto_describe=True)
        node_cost_gauge(registry).set(config.node_cost_per_hour)
        server = None
        if config.metrics_enabled:
            server = MetricsServer(registry, config.metrics_host, config.metrics_port)
        return cls(config, tracing, registry, server)

    @classmethod
    def disabled(cls, service_name: str = "pdserve") -> Telemetry:
        """No tracing and no endpoint (unit tests, embedded use)."""
        return cls(
            TelemetryConfig(metrics_port=-1), Tracing.disabled(service_name), CollectorRegistry()
        )

    def ready_fields(self) -> dict[str, object]:
        """What the ready line announces: the bound metrics port, when serving one."""
        return {"metrics_port": self.server.port} if self.server is not None else {}

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self.tracing.shutdown()


def node_cost_gauge(registry: CollectorRegistry) -> Gauge:
    """`pdserve_node_cost_per_hour`: every process exports what its node costs, so one
    query over a cluster's pods sums its cost (docs/observability.md#cost)."""
    return Gauge(
        "pdserve_node_cost_per_hour",
        "What this process's node (or its share of one) costs per hour (--node-cost-per-hour;"
        " 0 = not set)",
        registry=registry,
    )

"""Telemetry settings shared by every service: traces, Prometheus metrics, log format.

Lifecycle: each service command adds these fields as flags (`add_config_args`), builds the
frozen config once at start, and hands it to `Tracing.from_config`, `serve_metrics` and
`configure_logging`. `pdserve up` passes the same values to every child it launches with
`telemetry_args`, so one `--otlp-endpoint` on `up` reaches the whole cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import config_args

TRACE_EXPORTERS = ("auto", "none", "console", "otlp")
LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class TelemetryConfig:
    trace_exporter: str = field(
        default="auto",
        metadata={
            "help": "span exporter: none, console, otlp; auto = otlp when --otlp-endpoint is "
            "set, else none"
        },
    )
    otlp_endpoint: str = field(
        default="",
        metadata={"help": "OTLP/gRPC collector, host:port or http(s)://host:port (e.g. :4317)"},
    )
    trace_sample_ratio: float = field(
        default=1.0,
        metadata={"help": "fraction of new traces recorded (children follow their parent)"},
    )
    pod_name: str = field(
        default="", metadata={"help": "pod name resource attribute (Kubernetes downward API)"}
    )
    metrics_host: str = field(
        default="127.0.0.1", metadata={"help": "address the Prometheus /metrics endpoint binds"}
    )
    metrics_port: int = field(
        default=0,
        metadata={"help": "Prometheus /metrics port (0 = any free port, negative = off)"},
    )
    slo_ttft_s: float = field(
        default=1.0, metadata={"help": "goodput SLO: time to first token, seconds"}
    )
    slo_itl_s: float = field(
        default=0.1,
        metadata={"help": "goodput SLO: mean inter-token latency after token 1, seconds"},
    )
    log_format: str = field(
        default="text", metadata={"help": "log line format: text or json (request/trace ids)"}
    )
    node_cost_per_hour: float = field(
        default=0.0,
        metadata={
            "help": "what this process's node (or its share of one) costs per hour, in any "
            "currency: exported as pdserve_node_cost_per_hour for cost per million tokens "
            "at SLO (0 = not set)"
        },
    )

    def __post_init__(self) -> None:
        if self.trace_exporter not in TRACE_EXPORTERS:
            raise ValueError(
                f"trace_exporter must be one of {TRACE_EXPORTERS}, got {self.trace_exporter!r}"
            )
        if self.trace_exporter == "otlp" and not self.otlp_endpoint:
            raise ValueError("otlp_endpoint: trace_exporter otlp needs a collector address")
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ValueError(f"trace_sample_ratio must be in [0, 1], got {self.trace_sample_ratio}")
        if self.metrics_port >= 65536:
            raise ValueError(f"metrics_port must be < 65536, got {self.metrics_port}")
        if self.slo_ttft_s <= 0 or self.slo_itl_s <= 0:
            raise ValueError("slo_ttft_s and slo_itl_s must be > 0")
        if not self.node_cost_per_hour >= 0:
            raise ValueError(f"node_cost_per_hour must be >= 0, got {self.node_cost_per_hour}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")

    @property
    def exporter(self) -> str:
        """The exporter actually used (auto resolved)."""
        if self.trace_exporter == "auto":
            return "otlp" if self.otlp_endpoint else "none"
        return self.trace_exporter

    @property
    def metrics_enabled(self) -> bool:
        return self.metrics_port >= 0


def telemetry_args(cfg: TelemetryConfig, *, metrics_port: int | None = None) -> list[str]:
    """Flags that reproduce `cfg` for a child process (fields left at default are omitted).

    `metrics_port` overrides the port: children of one launcher cannot share a fixed one.
    """
    if metrics_port is None:
        return config_args(cfg)
    return config_args(cfg, metrics_port=metrics_port)

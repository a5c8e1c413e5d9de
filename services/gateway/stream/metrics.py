"""The gateway's request metrics: latency, goodput against the SLOs, outcomes, streams.

Lifecycle: the gateway's telemetry (`stream.telemetry.GatewayTelemetry`) makes one
`GatewayMetrics` on the process's registry at start; each request's `StreamTelemetry`
observes its latencies and counts its outcome, labelled by its served model (`NO_MODEL`
until one is resolved). Names: docs/observability.md.
"""

from __future__ import annotations

from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.gateway.stream.tenant_metrics import TenantMetrics, TokenUsage

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
#: The `model` label of a request refused while it was validated, before admission (its
#: model may be unknown there, and an unknown name is not a label value: a client could
#: make any number of series with it).
NO_MODEL = "-"


class GatewayMetrics:
    """Per-request latency, goodput against the SLOs, outcomes and the stream count,
    each by `model` (the served model's name, `--served-model-name` or a catalog entry;
    a LoRA adapter's requests count under their base model), so one gateway serving
    several models says which one is slow or failing."""

    def __init__(
        self,
        registry: CollectorRegistry,
        slo_ttft_s: float,
        slo_itl_s: float,
        tenant_labels: int = 20,
    ) -> None:
        """`tenant_labels`: how many tenants get their own label (`TenantMetrics`)."""
        self.registry = registry  # the process's: the HTTP API's /metrics serves it too
        self.slo_ttft_s = slo_ttft_s
        self.slo_itl_s = slo_itl_s
        self.tenants = TenantMetrics(registry, tenant_labels)
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Time from the gateway receiving a request to its first token",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds",
            "Time between successive tokens of a stream, per token",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Time from the gateway receiving a request to its last message",
            ["model"],
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.finished = Counter(
            "pdserve_requests",
            "Requests that ended normally, by finish reason, priority class and model",
            ["finish_reason", "priority", "model"],
            registry=registry,
        )
        self.goodput = Counter(
            "pdserve_goodput_requests",
            "Finished requests that met both the TTFT and the ITL SLO",
            ["model"],
            registry=registry,
        )
        self.goodput_tokens = Counter(
            "pdserve_goodput_tokens",
            "Output tokens of finished requests that met both SLOs (cost per million "
            "tokens at SLO divides by this)",
            ["model"],
            registry=registry,
        )
        self.slo_missed = Counter(
            "pdserve_slo_violations",
            "Finished requests that missed an SLO, by SLO (ttft or itl)",
            ["slo", "model"],
            registry=registry,
        )
        self.errors = Counter(
            "pdserve_request_errors",
            "Requests ended with an error, by gRPC status code and model (- for a request "
            "refused while it was validated, before admission)",
            ["code", "model"],
            registry=registry,
        )
        self.cancelled = Counter(
            "pdserve_requests_cancelled",
            "Requests the client cancelled (closed the stream) before the end",
            ["model"],
            registry=registry,
        )
        self.active = Gauge(
            "pdserve_active_streams", "Streams running in the gateway now", ["model"],
            registry=registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of finished requests", ["model"],
            registry=registry,
        )  # fmt: skip
        self.cached_tokens = Counter(
            "pdserve_cached_prompt_tokens",
            "Prompt tokens of finished requests served from a prefix cache",
            ["model"],
            registry=registry,
        )
        self.output_tokens = Counter(
            "pdserve_output_tokens", "Tokens streamed to clients", ["model"], registry=registry
        )
        self.migrations = Counter(
            "pdserve_stream_migrations",
            "Streams moved to another decode worker after theirs died or stalled, by "
            "outcome (moved, or refused: the request's limit reached, n > 1, no tokens "
            "out yet)",
            ["outcome"],
            registry=registry,
        )
        self.migration_prompt_kv = Counter(
            "pdserve_stream_migration_prompt_kv",
            "Streams moved to another decode worker, by where the new worker got the "
            "prompt's KV (imported: a prefill worker exported it again from its prefix "
            "cache; recomputed)",
            ["source"],
            registry=registry,
        )
        self.version_requests = Counter(
            "pdserve_model_version_requests",
            "Requests of a named model that reached a version, by model, version and "
            "outcome (ok or error): a rollout's split as it happened",
            ["model", "version", "outcome"],
            registry=registry,
        )
        self.rollbacks = Counter(
            "pdserve_rollout_rollbacks",
            "Canary versions this gateway rolled back automatically, by model",
            ["model"],
            registry=registry,
        )
        self.disaggregation = Counter(
            "pdserve_disaggregation_decisions",
            "Where each request's prompt was prefilled (disaggregated: a prefill worker; "
            "local: its decode worker), and why",
            ["mode", "reason"],
            registry=registry,
        )

    def record_finished(self, done: Finished) -> None:
        """Count a normal end and judge it against the SLOs (ITL: mean after token 1)."""
        model, ttft_s, e2e_s, tokens = done.model, done.ttft_s, done.e2e_s, done.output_tokens
        self.finished.labels(done.reason, done.priority, model).inc()
        self.e2e.labels(model).observe(e2e_s)
        itl = (e2e_s - ttft_s) / (tokens - 1) if tokens > 1 else 0.0
        ttft_ok = ttft_s <= self.slo_ttft_s
        itl_ok = itl <= self.slo_itl_s
        if not ttft_ok:
            self.slo_missed.labels("ttft", model).inc()
        if not itl_ok:
            self.slo_missed.labels("itl", model).inc()
        if ttft_ok and itl_ok:
            self.goodput.labels(model).inc()
            self.goodput_tokens.labels(model).inc(tokens)
        self.tenants.finished(done.tenant, done.priority, ttft_ok, itl_ok, done.usage)


class Finished(NamedTuple):
    """A request that ended normally, as the gateway's metrics judge it: its finish
    reason, time to first token, end-to-end time, output tokens, class, model, tenant
    and usage."""

    reason: str
    ttft_s: float
    e2e_s: float
    output_tokens: int
    priority: str = "standard"
    model: str = NO_MODEL
    tenant: str = ""
    usage: TokenUsage = (0, 0, 0)

"""Prometheus metrics of one service process and their `/metrics` HTTP endpoint.

Lifecycle: a service makes one `CollectorRegistry` (never the library's global one, so
tests and several services in one process never share counters), builds its role's
metric set on it (`GatewayMetrics`, `WorkerMetrics`, plus scrape-time collectors over
state that already exists: `EngineCollector` reads the engine's stats; the router's
`services.router.metrics.RouterCollector` its counters), and starts `MetricsServer` on
the configured port, whose bound port goes into the service's JSON ready line. Request
paths only observe histograms and bump counters (a few microseconds); gauges derived
from engine state cost nothing until a scrape. `close()` stops the HTTP server.

Names (all prefixed `pdserve_`): see docs/observability.md.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from engine.stats import EngineStats

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
#: The `model` label of a request refused while it was validated, before admission (its
#: model may be unknown there, and an unknown name is not a label value: a client could
#: make any number of series with it).
NO_MODEL = "-"


class GatewayMetrics:
    """Per-request latency, goodput against the SLOs, outcomes and the stream count,
    each by `model` (the served model's name, `--served-model-name` or a catalog entry;
    a LoRA adapter's requests count under their base model), so one gateway serving
    several models says which one is slow or failing."""

    def __init__(self, registry: CollectorRegistry, slo_ttft_s: float, slo_itl_s: float) -> None:
        self.registry = registry  # the process's: the HTTP API's /metrics serves it too
        self.slo_ttft_s = slo_ttft_s
        self.slo_itl_s = slo_itl_s
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

    def record_finished(
        self,
        reason: str,
        ttft_s: float,
        e2e_s: float,
        output_tokens: int,
        priority: str = "standard",
        model: str = NO_MODEL,
    ) -> None:
        """Count a normal end and judge it against the SLOs (ITL: mean after token 1)."""
        self.finished.labels(reason, priority, model).inc()
        self.e2e.labels(model).observe(e2e_s)
        itl = (e2e_s - ttft_s) / (output_tokens - 1) if output_tokens > 1 else 0.0
        ttft_ok = ttft_s <= self.slo_ttft_s
        itl_ok = itl <= self.slo_itl_s
        if not ttft_ok:
            self.slo_missed.labels("ttft", model).inc()
        if not itl_ok:
            self.slo_missed.labels("itl", model).inc()
        if ttft_ok and itl_ok:
            self.goodput.labels(model).inc()


class WorkerMetrics:
    """Queue and compute phases, KV transfers and outcomes of one worker."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue = Histogram(
            "pdserve_queue_time_seconds",
            "Time a request waited in the engine queue before its first batch, by phase",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=registry,
        )
        self.compute = Histogram(
            "pdserve_first_token_compute_seconds",
            "Time from first batch to this engine's first token, by phase",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=registry,
        )
        self.transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes", "KV bytes read from prefill workers", registry=registry
        )
        self.transfer_blocks = Counter(
            "pdserve_kv_transfer_blocks", "KV blocks read from prefill workers", registry=registry
        )
        self.transfer_seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "Duration of one KV import (handshake if any, read, release, commit)",
            buckets=PHASE_BUCKETS,
            registry=registry,
        )
        self.errors = Counter(
            "pdserve_request_errors",
            "RPCs ended with an error, by gRPC status code",
            ["code"],
            registry=registry,
        )
        self.cancelled = Counter(
            "pdserve_requests_cancelled",
            "Requests whose caller went away before they finished",
            registry=registry,
        )


def _offload_metrics(s: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The prefix cache's offload tier (all 0 without `--kv-offload-bytes`)."""
    tier = GaugeMetricFamily(
        "pdserve_kv_offload_blocks", "Offload tier blocks by state", labels=["state"]
    )
    tier.add_metric(["total"], s.offload_capacity_blocks)
    tier.add_metric(["cached"], s.offload_blocks)
    yield tier
    yield CounterMetricFamily(
        "pdserve_kv_offload_hit_tokens",
        "Prompt tokens served by copying blocks back from the offload tier "
        "(included in pdserve_prefix_cached_tokens)",
        value=s.offload_hit_tokens,
    )
    moved = CounterMetricFamily(
        "pdserve_kv_offload_blocks_moved", "Blocks copied into / out of the tier",
        labels=["direction"],
    )  # fmt: skip
    moved.add_metric(["spilled"], s.offload_spilled_total)
    moved.add_metric(["restored"], s.offload_restored_total)
    yield moved


def _spec_metrics(s: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Speculative decoding (all 0 unless `--speculative-decoding` is on)."""
    tokens = CounterMetricFamily(
        "pdserve_spec_tokens", "Draft tokens verified, and of those kept", labels=["kind"]
    )
    tokens.add_metric(["drafted"], s.spec_drafted_total)
    tokens.add_metric(["accepted"], s.spec_accepted_total)
    yield tokens
    yield CounterMetricFamily(
        "pdserve_spec_verifications",
        "Request-steps that verified draft tokens (each emits 1 + its kept drafts)",
        value=s.spec_verifications_total,
    )
    yield GaugeMetricFamily(
        "pdserve_spec_acceptance_rate",
        "Kept / verified draft tokens since start",
        value=s.spec_acceptance_rate,
    )


def _lora_metrics(s: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """LoRA adapters (all 0 without `--lora-dir`)."""
    adapters = GaugeMetricFamily(
        "pdserve_lora_adapters", "LoRA adapters resident, and of those held by live requests",
        labels=["state"],
    )  # fmt: skip
    adapters.add_metric(["resident"], len(s.lora_resident))
    adapters.add_metric(["held"], s.lora_held)
    yield adapters
    yield CounterMetricFamily(
        "pdserve_lora_loads", "LoRA adapters read from disk", value=s.lora_loads_total
    )
    yield CounterMetricFamily(
        "pdserve_lora_evictions",
        "LoRA adapters dropped to make room for another (--max-loras)",
        value=s.lora_evictions_total,
    )


class EngineCollector(Collector):
    """Gauges and counters read from `EngineStats` at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        util = s.used_blocks / s.total_blocks if s.total_blocks else 0.0
        yield GaugeMetricFamily(
            "pdserve_kv_block_utilization",
            "Fraction of KV blocks in use (running, held for export, importing)",
            value=util,
        )
        blocks = GaugeMetricFamily("pdserve_kv_blocks", "KV blocks by state", labels=["state"])
        for state, n in (
            ("total", s.total_blocks),
            ("used", s.used_blocks),
            ("free", s.free_blocks),
            ("cached", s.cached_blocks),
            ("held", s.held_blocks),
            ("importing", s.importing_blocks),
        ):
            blocks.add_metric([state], n)
        yield blocks
        yield GaugeMetricFamily(
            "pdserve_num_requests_waiting", "Requests queued in the engine", value=s.waiting
        )
        yield GaugeMetricFamily(
            "pdserve_num_requests_running", "Requests in the engine's batch", value=s.running
        )
        yield GaugeMetricFamily(
            "pdserve_num_prompt_tokens_waiting",
            "Prompt tokens the engine still owes prefill (waiting and still-prefilling "
            "requests, every class): what the prefill pool's autoscaler sizes on",
            value=sum(s.waiting_tokens_by_class),
        )
        yield CounterMetricFamily(
            "pdserve_prefix_cached_tokens",
            "Prompt tokens found in the prefix cache (hit ratio = this / prompt tokens)",
            value=s.prefix_hit_tokens,
        )
        yield CounterMetricFamily(
            "pdserve_prefix_prompt_tokens",
            "Prompt tokens looked up in the prefix cache",
            value=s.prefix_query_tokens,
        )
        yield GaugeMetricFamily(
            "pdserve_prefix_hit_ratio",
            "Cached / prompt tokens since start",
            value=s.prefix_hit_ratio,
        )
        yield CounterMetricFamily(
            "pdserve_preemptions", "Requests preempted by recompute", value=s.num_preemptions
        )
        yield from _offload_metrics(s)
        yield from _spec_metrics(s)
        yield from _lora_metrics(s)


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

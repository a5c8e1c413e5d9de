"""A worker's metrics: queue and compute phases, KV transfers and outcomes, and the
engine's own counts, read at scrape time.

Lifecycle: a worker's telemetry (`engine_host.telemetry.WorkerTelemetry.on`) makes one
`WorkerMetrics` on the process's registry and registers an `EngineCollector` over the
engine's `stats()`; handlers observe phases and count outcomes per request; the engine's
gauges cost nothing until a scrape. Names: docs/observability.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.stats import EngineStats

PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


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
        self.checksum_failures = Counter(
            "pdserve_kv_checksum_failures",
            "KV imports with blocks that failed their checksum, by outcome: repaired (a "
            "re-read matched) or lost (the prompt was computed again)",
            ["outcome"],
            registry=registry,
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
        self.role_changes = Counter(
            "pdserve_worker_role_changes",
            "Run-time changes of the worker's home role, by the role left and the role taken, "
            "and why (planner: the mix shifted; operator: a SetRole call)",
            ["previous", "role", "reason"],
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


def _roof_metrics(s: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Decode against the memory roof: rate(roof) / rate(busy) is the fraction reached
    (the recording rule pdserve:decode_roof_fraction:rate5m)."""
    yield CounterMetricFamily(
        "pdserve_decode_only_busy_seconds",
        "Wall time of steps that ran only decodes",
        value=s.decode_only_busy_s_total,
    )
    yield CounterMetricFamily(
        "pdserve_decode_roof_seconds",
        "The least time those steps' reads could take: weights and context KV over the "
        "memory bandwidth",
        value=s.decode_roof_s_total,
    )
    yield GaugeMetricFamily(
        "pdserve_memory_bandwidth_bytes_per_second",
        "The read bandwidth the decode roof assumes (--memory-bandwidth-gb-s, or measured)",
        value=s.memory_bandwidth_bytes_s,
    )


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
            "pdserve_preemptions", "Requests preempted for KV blocks", value=s.num_preemptions
        )
        resumed = CounterMetricFamily(
            "pdserve_preemption_resume_tokens",
            "Tokens preempted requests got back on resume: copied from the offload tier "
            "(swapped) or computed again (recomputed)",
            labels=["how"],
        )
        resumed.add_metric(["swapped"], s.swapped_in_tokens_total)
        resumed.add_metric(["recomputed"], s.recomputed_tokens_total)
        yield resumed
        yield from _roof_metrics(s)
        yield from _offload_metrics(s)
        yield from _spec_metrics(s)
        yield from _lora_metrics(s)

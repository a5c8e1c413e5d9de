"""A worker's telemetry: spans and metrics for the phases its engine measured.

Lifecycle: `serve_worker` builds one `WorkerTelemetry.on(telemetry, engine, worker_id)`
(registering `WorkerMetrics` and the scrape-time `EngineCollector` on the process's
registry) and hands it to the prefill and decode handlers. Per RPC a handler reads the
caller's trace context (`parent`), and once the engine reports a request's first token it
turns the engine's timestamps into phases (`engine_phases`: queue = arrival to first
batch, then first batch to first token), which `emit` records as spans under the
gateway's root span and returns as `PhaseTiming`s for the response. The engine itself
never imports OpenTelemetry: it only stamps `time.monotonic()` on the request.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from opentelemetry.context import Context

from engine.engine import LLMEngine
from engine.request import RequestOutput
from pdserve.v1 import common_pb2
from services.common.telemetry import Telemetry
from services.common.tracing import Attributes, Phase, Tracing
from services.engine_host.metrics import EngineCollector, WorkerMetrics

#: Second phase name per role: prefill computes the prompt; decode waits for its token.
FIRST_TOKEN_PHASE = {"prefill": "prefill.compute", "decode": "decode.first_token"}


class WorkerTelemetry:
    def __init__(self, tracing: Tracing, metrics: WorkerMetrics | None, worker_id: str) -> None:
        self.tracing = tracing
        self.metrics = metrics
        self.worker_id = worker_id

    @classmethod
    def disabled(cls, worker_id: str = "") -> WorkerTelemetry:
        return cls(Tracing.disabled(), None, worker_id)

    @classmethod
    def on(cls, telemetry: Telemetry, engine: LLMEngine, worker_id: str) -> WorkerTelemetry:
        metrics = WorkerMetrics(telemetry.registry)
        telemetry.registry.register(EngineCollector(engine.stats))
        return cls(telemetry.tracing, metrics, worker_id)

    def parent(self, context: grpc.aio.ServicerContext) -> Context | None:
        """The caller's trace context (None when tracing is off or the call carries none)."""
        if not self.tracing.enabled:
            return None
        return self.tracing.extract(context.invocation_metadata())

    def engine_phases(self, stage: str, out: RequestOutput) -> list[Phase]:
        """Queue and first-token phases of `stage` ("prefill" or "decode") from the
        engine's timestamps on its first output; observes the matching histograms."""
        scheduled, first = out.first_scheduled_time, out.first_token_time
        if scheduled is None or first is None:
            return []  # aborted before it ran: nothing was measured
        if self.metrics is not None:
            self.metrics.queue.labels(stage).observe(scheduled - out.arrival_time)
            self.metrics.compute.labels(stage).observe(first - scheduled)
        return [
            Phase(f"{stage}.queue", out.arrival_time, scheduled),
            Phase(FIRST_TOKEN_PHASE[stage], scheduled, first),
        ]

    def emit(
        self, phases: Iterable[Phase], parent: Context | None, attributes: Attributes
    ) -> list[common_pb2.PhaseTiming]:
        attrs = {"pdserve.worker_id": self.worker_id, **attributes}
        return self.tracing.emit(phases, parent, self.worker_id, attrs)

    def count_error(self, code: grpc.StatusCode) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(code.name).inc()

    def count_cancelled(self) -> None:
        if self.metrics is not None:
            self.metrics.cancelled.inc()

    def count_role_change(self, previous: str, role: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.role_changes.labels(previous, role, reason).inc()

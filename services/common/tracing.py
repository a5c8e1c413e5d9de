"""OpenTelemetry tracing for one service process, and W3C trace context over gRPC metadata.

Lifecycle: a service builds `Tracing.from_config(telemetry, service_name, worker_id)` once
at start. With the exporter `none` (the default) it holds the API's no-op tracer and every
call below returns at once: no provider, no processor, no thread. Otherwise it owns a
`TracerProvider` (this process's resource: service.name, worker id, pod name) with a
`BatchSpanProcessor` feeding the console or an OTLP/gRPC exporter; nothing is installed
globally. Per request:

- the gateway opens the root span (`start`) and passes `metadata(span)` on each gRPC call;
- a server reads the caller's context with `extract(context.invocation_metadata())`;
- workers turn the engine's monotonic phase timestamps into spans with `emit`, which also
  returns the same intervals as `PhaseTiming` protos for the gateway's `--trace` timeline.

`shutdown()` flushes the batch processor (spans still queued are exported) and stops it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from pdserve.v1 import common_pb2
from services.common.telemetry_config import TelemetryConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)

#: W3C trace context is two headers; gRPC metadata keys are lower case.
TRACE_HEADERS = ("traceparent", "tracestate")
Metadata = tuple[tuple[str, str], ...]
Attributes = Mapping[str, AttributeValue]

_PROPAGATOR = TraceContextTextMapPropagator()  # stateless


def epoch_ns(monotonic_s: float) -> int:
    """Wall-clock nanoseconds of a `time.monotonic()` reading taken in this process."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def trace_id_hex(span: Span) -> str:
    """The span's trace id as 32 hex digits, or "" for a no-op span."""
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def trace_id_from_metadata(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The trace id in a W3C `traceparent` header ("" if none): logs carry it even in a
    process that records no spans itself."""
    for key, value in metadata or ():
        if key == "traceparent" and isinstance(value, str):
            parts = value.split("-")
            return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else ""
    return ""


@dataclass(frozen=True)
class Phase:
    """One interval of a request measured in this process (monotonic seconds)."""

    name: str
    start: float
    end: float
    attributes: Attributes = field(default_factory=dict)

    def timing(self, worker_id: str) -> common_pb2.PhaseTiming:
        start = epoch_ns(self.start)
        return common_pb2.PhaseTiming(
            name=self.name,
            start_unix_nano=start,
            end_unix_nano=start + int(max(self.end - self.start, 0.0) * 1e9),
            worker_id=worker_id,
        )


class Tracing:
    """This process's tracer; a no-op unless an exporter is configured."""

    def __init__(self, provider: TracerProvider | None, service_name: str) -> None:
        self._provider = provider
        self.service_name = service_name
        self.enabled = provider is not None
        if provider is None:
            self.tracer: trace.Tracer = trace.NoOpTracer()
        else:
            self.tracer = provider.get_tracer("pdserve")

    @classmethod
    def disabled(cls, service_name: str = "pdserve") -> Tracing:
        return cls(None, service_name)

    @classmethod
    def from_config(cls, cfg: TelemetryConfig, service_name: str, worker_id: str = "") -> Tracing:
        if cfg.exporter == "none":
            return cls.disabled(service_name)
        # Imported only when tracing is on: the SDK is not needed for a no-op tracer.
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        attrs: dict[str, AttributeValue] = {"service.name": service_name}
        if worker_id:
            attrs["service.instance.id"] = worker_id
            attrs["pdserve.worker_id"] = worker_id
        if cfg.pod_name:
            attrs["k8s.pod.name"] = cfg.pod_name
        exporter: SpanExporter
        if cfg.exporter == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            # stderr: a service's stdout carries only its JSON ready line for a launcher.
            exporter = ConsoleSpanExporter(service_name=service_name, out=sys.stderr)
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            endpoint = cfg.otlp_endpoint
            exporter = OTLPSpanExporter(
                endpoint=endpoint, insecure=not endpoint.startswith("https://")
            )
        provider = TracerProvider(
            resource=Resource.create(attrs),
            sampler=ParentBased(TraceIdRatioBased(cfg.trace_sample_ratio)),
        )
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        log.info("tracing: %s exporter for %s", cfg.exporter, service_name)
        return cls(provider, service_name)

    # -- spans --------------------------------------------------------------------------
    def start(
        self,
        name: str,
        parent: Context | None = None,
        attributes: Attributes | None = None,
        *,
        start_ns: int | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
    ) -> Span:
        """Start a span (not made current: contexts are passed explicitly)."""
        return self.tracer.start_span(
            name, context=parent, kind=kind, attributes=attributes, start_time=start_ns
        )

    def emit(
        self,
        phases: Iterable[Phase],
        parent: Context | None,
        worker_id: str,
        attributes: Attributes | None = None,
    ) -> list[common_pb2.PhaseTiming]:
        """Record each phase as a span under `parent` (with `attributes` on every one) and
        return the phases as timings; spans are only built when tracing is on."""
        timings = []
        for phase in phases:
            timing = phase.timing(worker_id)
            timings.append(timing)
            if self.enabled:
                span = self.start(
                    phase.name,
                    parent,
                    {**(attributes or {}), **phase.attributes},
                    start_ns=timing.start_unix_nano,
                )
                span.end(end_time=timing.end_unix_nano)
        return timings

    @staticmethod
    def fail(span: Span, code: str, message: str) -> None:
        """Mark a span failed with a gRPC status code name (e.g. "UNAVAILABLE")."""
        if span.is_recording():
            span.set_attribute("rpc.grpc.status_code", code)
            span.set_status(Status(StatusCode.ERROR, f"{code}: {message}"))

    # -- propagation ------------------------------------------------------------------
    def metadata(self, span: Span | None) -> Metadata:
        """gRPC metadata carrying `span` as the parent of the callee's spans."""
        if not self.enabled or span is None or not span.get_span_context().is_valid:
            return ()
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return tuple(carrier.items())

    def extract(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Context | None:
        """The caller's context from incoming gRPC metadata, or None when there is none."""
        if not self.enabled or not metadata:
            return None
        carrier = {k: v for k, v in metadata if k in TRACE_HEADERS and isinstance(v, str)}
        if "traceparent" not in carrier:
            return None
        return _PROPAGATOR.extract(carrier)

    @staticmethod
    def context_of(span: Span) -> Context:
        return trace.set_span_in_context(span)

    def shutdown(self) -> None:
        """Flush queued spans to the exporter and stop the processor thread."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None

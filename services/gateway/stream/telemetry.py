"""The gateway's per-request telemetry: the root span, the phase timeline, and metrics.

Lifecycle: the service owns one `GatewayTelemetry` (tracer + `GatewayMetrics`, or neither
in tests). Each `RequestStream` makes a `StreamTelemetry`; its `begin` opens the root
span `gateway.generate` (when tracing is on), whose context travels in the metadata of
every worker call (`metadata()`), so the workers' spans join this trace as its children.
The stream reports each placement (`route`, one `router.route` span per attempt), the
phase timings workers send back (`add_phases`), every token delta (`on_tokens`: TTFT and
inter-token latency), and its final message (`finish`, which fills the message's trace id
and timeline and records end-to-end latency and goodput). `end` runs last, whatever
happened: it counts an error by status code or a cancel, and ends the root span.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import grpc
from opentelemetry.trace import Span, SpanKind

from engine.priority import Priority
from pdserve.v1 import common_pb2, gateway_pb2
from services.common.status import code_for
from services.common.telemetry import Telemetry
from services.common.tracing import Metadata, Phase, Tracing, trace_id_hex
from services.gateway.flow.prefill_site import SiteChoice
from services.gateway.stream.metrics import NO_MODEL, Finished, GatewayMetrics
from services.gateway.stream.tenant_metrics import TenantOutcome
from services.router.metrics import RouterCollector
from services.router.placement import Placement, RouteDecision
from services.router.redis_placement import RedisPlacement
from services.router.router import RouterStats, total


class MigrationOutcome(enum.Enum):
    """What became of a stream whose decode worker was lost (the metric's label)."""

    MOVED = "moved"  # placed on another decode worker, resuming after its tokens
    REPREFILL = "reprefill"  # its KV was lost at the hand-off: the same worker prefills
    LIMIT = "limit"  # max_migrations reached: the stream ends with the worker's status
    FORKS = "forks"  # n > 1: forks do not move
    NO_TOKENS = "no_tokens"  # nothing went out yet: the stream's own errors apply
    NO_WORKER = "no_worker"  # no other decode worker to move to


class PromptKvSource(enum.Enum):
    """Where a moved stream's new decode worker got the prompt's KV (a metric's label)."""

    IMPORTED = "imported"  # a prefill worker exported it again (from its prefix cache)
    RECOMPUTED = "recomputed"  # the new decode worker computed it


class GatewayTelemetry:
    """One per gateway process."""

    def __init__(self, tracing: Tracing, metrics: GatewayMetrics | None) -> None:
        self.tracing = tracing
        self.metrics = metrics

    @classmethod
    def disabled(cls) -> GatewayTelemetry:
        return cls(Tracing.disabled("pdserve-gateway"), None)

    @classmethod
    def on(
        cls,
        telemetry: Telemetry,
        placements: Callable[[], Iterable[Placement]],
        tenant_labels: int = 20,
    ) -> GatewayTelemetry:
        """Register the gateway's metrics, and the counters of its embedded routers (one
        per model version: `placements` lists them at scrape time, summed), on the
        process's registry; `tenant_labels` tenants get their own label."""
        cfg = telemetry.config
        metrics = GatewayMetrics(telemetry.registry, cfg.slo_ttft_s, cfg.slo_itl_s, tenant_labels)

        def routed() -> RouterStats:
            return total(p.router.stats for p in placements() if isinstance(p, RedisPlacement))

        telemetry.registry.register(RouterCollector(routed))
        return cls(telemetry.tracing, metrics)

    def stream(self, labels: StreamLabels) -> StreamTelemetry:
        """One request's telemetry."""
        return StreamTelemetry(self, labels)

    def count_version(self, model: str, version: str, ok: bool) -> None:
        """A request of a named model ended on `version` (a rollout's split)."""
        if self.metrics is not None:
            outcome = "ok" if ok else "error"
            self.metrics.version_requests.labels(model, version or "-", outcome).inc()

    def count_rollback(self, model: str) -> None:
        if self.metrics is not None:
            self.metrics.rollbacks.labels(model).inc()

    def count_error(self, code: grpc.StatusCode, model: str = NO_MODEL) -> None:
        """A request refused before it had a stream (bad input, stream cap); `model` once
        its served model is known."""
        if self.metrics is not None:
            self.metrics.errors.labels(code.name, model).inc()

    def count_refusal(self, exc: BaseException, model: str = NO_MODEL) -> None:
        """`count_error` for an exception raised while validating or admitting a request."""
        self.count_error(code_for(exc), model)

    def count_tenant_refusal(self, tenant: str, priority: Priority) -> None:
        """A tenant's request refused at admission (quota, overload, stream cap)."""
        if self.metrics is not None:
            self.metrics.tenants.ended(tenant, priority.label, TenantOutcome.REFUSED)


@dataclass(frozen=True)
class StreamLabels:
    """What names one request in its root span's attributes; `priority` and `model` (its
    served model's name) label its metrics too."""

    request_id: str
    tenant: str
    prompt_tokens: int
    priority: Priority = Priority.STANDARD
    model: str = NO_MODEL


class StreamTelemetry:
    def __init__(self, owner: GatewayTelemetry, labels: StreamLabels) -> None:
        self._tracing = owner.tracing
        self._metrics = owner.metrics
        self._request_id = labels.request_id
        self._tenant = labels.tenant
        self._prompt_tokens = labels.prompt_tokens
        self._priority = labels.priority.label
        self._model = labels.model
        self.start = time.monotonic()
        self._first_at: float | None = None
        self._last_at = 0.0
        self._tokens = 0
        self._outcome = ""  # "finished", "cancelled" or a status code name
        self._phases: list[common_pb2.PhaseTiming] = []
        self._routes: list[Phase] = []
        self.root: Span | None = None
        self._metadata: Metadata = ()

    def begin(self) -> None:
        """The stream starts: open the root span and count it as active."""
        self.start = time.monotonic()
        if self._tracing.enabled:
            self.root = self._tracing.start(
                "gateway.generate",
                attributes={
                    "pdserve.request_id": self._request_id,
                    "pdserve.tenant": self._tenant,
                    "pdserve.prompt_tokens": self._prompt_tokens,
                    "pdserve.priority": self._priority,
                    "pdserve.model": self._model,
                },
                kind=SpanKind.SERVER,
            )
            self._metadata = self._tracing.metadata(self.root)
        if self._metrics is not None:
            self._metrics.active.labels(self._model).inc()

    @property
    def trace_id(self) -> str:
        return trace_id_hex(self.root) if self.root is not None else ""

    def metadata(self) -> Metadata:
        """gRPC metadata for calls made on behalf of this request (empty if not traced)."""
        return self._metadata

    async def route(self, call: Awaitable[RouteDecision], attempt: int) -> RouteDecision:
        """Await a placement, recording it as `router.route`."""
        start = time.monotonic()
        attrs: dict[str, str | int] = {"pdserve.attempt": attempt}
        try:
            decision = await call
        except Exception as exc:
            self._phase_span("router.route", start, {**attrs, "error": str(exc)}, failed=True)
            raise
        if decision.prefill is not None:
            attrs["pdserve.prefill_worker"] = decision.prefill.worker_id
        attrs["pdserve.decode_worker"] = decision.decode.worker_id
        if self.root is not None:
            self.root.set_attributes(attrs)
        self._phase_span("router.route", start, attrs, failed=False)
        return decision

    def _phase_span(
        self, name: str, start: float, attrs: dict[str, str | int], *, failed: bool
    ) -> None:
        """A gateway phase from `start` (monotonic) to now: in the timeline, and a child
        span of the root (failed: with the `error` attribute as its status message)."""
        phase = Phase(name, start, time.monotonic(), attrs)
        self._routes.append(phase)
        if self.root is None:
            return
        span = self._tracing.start(
            name,
            Tracing.context_of(self.root),
            attrs,
            start_ns=phase.timing("").start_unix_nano,
        )
        if failed:
            Tracing.fail(span, "UNAVAILABLE", str(attrs.get("error", "")))
        span.end()

    def migrated(
        self,
        start: float,
        attrs: dict[str, str | int],
        outcome: MigrationOutcome,
        prompt_kv: PromptKvSource | None = None,
    ) -> None:
        """A stream's move to another decode worker (or the refusal to move it): a
        `migration` phase and span from `start` (monotonic) to now, counted by outcome;
        a move also by where its prompt's KV came from (`prompt_kv`)."""
        attrs = {**attrs, "pdserve.migration.outcome": outcome.value}
        if prompt_kv is not None:
            attrs["pdserve.migration.prompt_kv"] = prompt_kv.value
        self._phase_span("migration", start, attrs, failed=False)
        if self._metrics is not None:
            self._metrics.migrations.labels(outcome.value).inc()
            if prompt_kv is not None:
                self._metrics.migration_prompt_kv.labels(prompt_kv.value).inc()

    def disaggregation(self, choice: SiteChoice) -> None:
        """Where the prompt is prefilled and why: root span attributes and a count."""
        mode, reason = choice.site.value, choice.reason.value
        if self.root is not None:
            self.root.set_attributes(
                {"pdserve.disaggregation": mode, "pdserve.disaggregation_reason": reason}
            )
        if self._metrics is not None:
            self._metrics.disaggregation.labels(mode, reason).inc()

    def add_phases(self, phases: Iterable[common_pb2.PhaseTiming]) -> None:
        self._phases.extend(phases)

    def on_tokens(self, n: int) -> None:
        now = time.monotonic()
        if self._first_at is None:
            self._first_at = now
            if self._metrics is not None:
                self._metrics.ttft.labels(self._model).observe(now - self.start)
        elif self._metrics is not None and n > 0:
            self._metrics.itl.labels(self._model).observe((now - self._last_at) / n)
        self._last_at = now
        self._tokens += n

    def finish(self, msg: gateway_pb2.GenerateResponse, *, with_timeline: bool = True) -> None:
        """Fill the final message's trace id and timeline; record latency and goodput."""
        now = time.monotonic()
        self._outcome = "finished"
        reason = common_pb2.FinishReason.Name(msg.finish_reason)
        if self.root is not None:
            self.root.set_attributes(
                {
                    "pdserve.cached_tokens": msg.usage.cached_tokens,
                    "pdserve.output_tokens": msg.usage.completion_tokens,
                    "pdserve.finish_reason": reason,
                    "rpc.grpc.status_code": "OK",
                }
            )
            msg.trace_id = self.trace_id
        if with_timeline:
            msg.phases.append(Phase("gateway.generate", self.start, now).timing(""))
            msg.phases.extend(p.timing("") for p in self._routes)
            msg.phases.extend(sorted(self._phases, key=lambda p: p.start_unix_nano))
        m = self._metrics
        if m is not None:
            ttft = (self._first_at or now) - self.start
            model = self._model
            e2e = now - self.start
            u = msg.usage
            usage = (u.prompt_tokens, u.cached_tokens, u.completion_tokens)
            tenant = self._tenant
            m.record_finished(
                Finished(reason, ttft, e2e, self._tokens, self._priority, model, tenant, usage)
            )
            m.prompt_tokens.labels(model).inc(msg.usage.prompt_tokens)
            m.cached_tokens.labels(model).inc(msg.usage.cached_tokens)
            m.output_tokens.labels(model).inc(self._tokens)

    def cancelled(self) -> None:
        if not self._outcome:
            self._outcome = "cancelled"
            if self.root is not None:
                Tracing.fail(self.root, "CANCELLED", "the client went away")
            if self._metrics is not None:
                self._metrics.cancelled.labels(self._model).inc()
                self._metrics.tenants.ended(self._tenant, self._priority, TenantOutcome.CANCELLED)

    def failed(self, code: grpc.StatusCode, message: str) -> None:
        if not self._outcome:
            self._outcome = code.name
            if self.root is not None:
                Tracing.fail(self.root, code.name, message)
            if self._metrics is not None:
                self._metrics.errors.labels(code.name, self._model).inc()
                self._metrics.tenants.ended(self._tenant, self._priority, TenantOutcome.FAILED)

    def end(self) -> None:
        if self._metrics is not None:
            self._metrics.active.labels(self._model).dec()
        if self.root is not None:
            self.root.end()

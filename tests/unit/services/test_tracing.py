"""Tracing, telemetry config, log format, metrics and the --trace table, one class each.

Spans go to the SDK's in-memory exporter (a real TracerProvider); metrics to a real
CollectorRegistry served over HTTP on 127.0.0.1.
"""

from __future__ import annotations

import io
import json
import logging
import time
import urllib.request

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from pdserve.v1 import common_pb2, gateway_pb2
from services.cli.timeline import format_timeline
from services.common.log_format import configure_logging, log_context
from services.common.metrics import MetricsServer
from services.common.telemetry_config import TelemetryConfig, telemetry_args
from services.common.tracing import Phase, Tracing, trace_id_from_metadata, trace_id_hex
from services.gateway.stream.metrics import Finished, GatewayMetrics


def _traced() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, "test"), exporter


def test_context_round_trips_through_grpc_metadata() -> None:
    tracing, exporter = _traced()
    root = tracing.start("gateway.generate")
    metadata = tracing.metadata(root)
    assert [k for k, _ in metadata] == ["traceparent"]
    assert trace_id_from_metadata(metadata) == trace_id_hex(root)
    parent = tracing.extract([("user-agent", "x"), *metadata])
    child = tracing.start("prefill.queue", parent)
    child.end()
    root.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["prefill.queue"].parent is not None
    assert spans["prefill.queue"].parent.span_id == root.get_span_context().span_id
    assert spans["prefill.queue"].context.trace_id == root.get_span_context().trace_id


def test_disabled_tracing_is_a_no_op() -> None:
    tracing = Tracing.from_config(TelemetryConfig(), "pdserve-gateway")
    assert not tracing.enabled
    span = tracing.start("gateway.generate")
    assert tracing.metadata(span) == () and trace_id_hex(span) == ""
    assert tracing.extract([("traceparent", "00-" + "a" * 32 + "-" + "b" * 16 + "-01")]) is None
    timings = tracing.emit([Phase("prefill.queue", 1.0, 1.5)], None, "w")
    assert len(timings) == 1  # timings still flow to the client without spans
    tracing.shutdown()


def test_emit_records_phases_with_engine_times() -> None:
    tracing, exporter = _traced()
    now = time.monotonic()
    phases = [
        Phase("prefill.queue", now - 0.3, now - 0.2),
        Phase("prefill.compute", now - 0.2, now),
    ]
    timings = tracing.emit(phases, None, "prefill-0", {"pdserve.request_id": "r1"})
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["prefill.queue", "prefill.compute"]
    for span, timing in zip(spans, timings, strict=True):
        assert span.start_time == timing.start_unix_nano and span.end_time == timing.end_unix_nano
        assert span.attributes is not None and span.attributes["pdserve.request_id"] == "r1"
        assert timing.worker_id == "prefill-0"
    assert abs((timings[0].end_unix_nano - timings[0].start_unix_nano) - 100_000_000) < 1_000_000
    assert abs(timings[1].end_unix_nano - time.time_ns()) < 50_000_000


def test_telemetry_config_validates_and_round_trips() -> None:
    with pytest.raises(ValueError, match="trace_exporter"):
        TelemetryConfig(trace_exporter="zipkin")
    with pytest.raises(ValueError, match="otlp_endpoint"):
        TelemetryConfig(trace_exporter="otlp")
    with pytest.raises(ValueError, match="log_format"):
        TelemetryConfig(log_format="xml")
    cfg = TelemetryConfig(otlp_endpoint="127.0.0.1:4317", metrics_port=9100, log_format="json")
    assert cfg.exporter == "otlp" and TelemetryConfig().exporter == "none"
    args = telemetry_args(cfg, metrics_port=0)
    assert args == ["--otlp-endpoint", "127.0.0.1:4317", "--log-format", "json"]


def test_json_logs_carry_request_and_trace_ids() -> None:
    logger = logging.getLogger("pdserve.test.logs")
    logger.propagate = False
    stream = io.StringIO()
    logger.addHandler(logging.StreamHandler(stream))
    logger.setLevel(logging.INFO)
    configure_logging("json", logger)
    with log_context("req-7", "ab" * 16):
        logger.info("placed")
    logger.info("idle")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["request_id"] == "req-7" and first["trace_id"] == "ab" * 16
    assert first["message"] == "placed" and second["request_id"] == "-"


def test_gateway_metrics_served_and_goodput_judged() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, slo_ttft_s=0.5, slo_itl_s=0.05)
    metrics.record_finished(
        Finished("FINISH_REASON_STOP", ttft_s=0.1, e2e_s=0.5, output_tokens=11, model="small")
    )
    metrics.record_finished(
        Finished("FINISH_REASON_LENGTH", ttft_s=0.9, e2e_s=2.0, output_tokens=11,
                 priority="critical", model="large")
    )  # fmt: skip
    server = MetricsServer(registry, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.close()
    # Each series by model: the slow one missed both SLOs, the other met them.
    assert 'pdserve_goodput_requests_total{model="small"} 1.0' in text
    assert 'pdserve_goodput_requests_total{model="large"}' not in text
    assert 'pdserve_slo_violations_total{model="large",slo="ttft"} 1.0' in text
    assert 'pdserve_slo_violations_total{model="large",slo="itl"} 1.0' in text
    assert 'pdserve_slo_violations_total{model="small"' not in text
    assert 'pdserve_e2e_request_latency_seconds_count{model="small"} 1.0' in text
    assert 'pdserve_e2e_request_latency_seconds_count{model="large"} 1.0' in text
    for reason, priority, model in (("STOP", "standard", "small"), ("LENGTH", "critical", "large")):
        labels = f'finish_reason="FINISH_REASON_{reason}",model="{model}",priority="{priority}"'
        assert f"pdserve_requests_total{{{labels}}} 1.0" in text


def test_timeline_table_orders_phases_from_the_root() -> None:
    base = 1_700_000_000_000_000_000
    msg = gateway_pb2.GenerateResponse(trace_id="f" * 32)
    for name, start, end, who in (
        ("prefill.queue", 2, 3, "prefill-0"),
        ("gateway.generate", 0, 20, ""),
        ("router.route", 1, 2, ""),
    ):
        msg.phases.append(
            common_pb2.PhaseTiming(
                name=name,
                start_unix_nano=base + start * 10**6,
                end_unix_nano=base + end * 10**6,
                worker_id=who,
            )
        )
    lines = format_timeline(msg).splitlines()
    assert lines[0] == "trace " + "f" * 32
    assert [line.split()[0] for line in lines[2:]] == [
        "gateway.generate",
        "router.route",
        "prefill.queue",
    ]
    assert lines[4].split() == ["prefill.queue", "prefill-0", "2.00", "1.00"]

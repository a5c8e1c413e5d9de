"""Traces and metrics through real processes: gateway (Redis placement), one prefill and one
decode worker (KV over NIXL), exporting spans over OTLP/gRPC to a real TraceService
server started here, and serving Prometheus /metrics. One cluster serves both the trace
checks and the metric checks (the metrics acceptance tests live here to share it). The
cancel test ends with the leak probe (`leak_check`)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2 as otlp_common

from pdserve.v1 import gateway_pb2
from services.cli.timeline import format_timeline
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from services.common.metrics import family_total, scrape
from services.common.telemetry_config import TelemetryConfig
from services.gateway.client import GatewayClient, RequestOptions, build_request
from tests.conftest import MODEL_CACHE
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.pins import Pin

# Runs beside one other pairable file in make test (tests/conftest.py).
# Pins (tests/integration/pins.py): one trace holds every phase of the hop, the KV
# transfer included, for a short prompt.
pytestmark = [pytest.mark.pairable, pytest.mark.pins(Pin.PREFILL_HOP)]

PHASES = [
    "gateway.generate",
    "router.route",
    "prefill.queue",
    "prefill.compute",
    "kv.transfer",
    "decode.queue",
    "decode.first_token",
    "decode.stream",
]
SERVICE_OF = {
    "gateway.generate": "pdserve-gateway",
    "router.route": "pdserve-gateway",
    "prefill.queue": "pdserve-prefill",
    "prefill.compute": "pdserve-prefill",
    "kv.transfer": "pdserve-decode",
    "decode.queue": "pdserve-decode",
    "decode.first_token": "pdserve-decode",
    "decode.stream": "pdserve-decode",
}
# Long enough for several full KV blocks (16 tokens each), so the transfer moves blocks.
STORY = (
    "A lighthouse keeper on a remote island keeps a logbook of every ship that passes, "
    "every storm that rolls in from the west, and every bird that lands on the railing. "
)


@dataclass
class SpanRecord:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start: int
    end: int
    attributes: dict[str, object]
    status_code: int


def _value(v: otlp_common.AnyValue) -> object:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace receiver that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []
        self._lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        records = []
        for rs in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    records.append(
                        SpanRecord(
                            str(resource.get("service.name")),
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            {kv.key: _value(kv.value) for kv in s.attributes},
                            s.status.code,
                        )
                    )
        with self._lock:
            self.spans.extend(records)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, request_id: str, names: list[str], timeout: float) -> list[SpanRecord]:
        """Spans of the trace whose root carries `request_id`, once all `names` arrived."""
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                roots = [
                    s
                    for s in self.spans
                    if s.name == "gateway.generate"
                    and s.attributes.get("pdserve.request_id") == request_id
                ]
                trace = [s for s in self.spans if roots and s.trace_id == roots[0].trace_id]
            if roots and set(names) <= {s.name for s in trace}:
                return trace
            if time.monotonic() > end:
                raise AssertionError(f"missing spans: {set(names) - {s.name for s in trace}}")
            time.sleep(0.1)


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    sink = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink, port
    server.stop(grace=None)


@pytest.fixture(scope="module")
def cluster(collector: tuple[Collector, int]) -> Iterator[LocalCluster]:
    cfg = ClusterConfig(
        gateway_port=0,
        model_cache_dir=MODEL_CACHE,
        placement="redis",
        worker_kv_cache_bytes=96 << 20,
        num_prefill=1,
        num_decode=1,
    )
    c = LocalCluster(cfg, TelemetryConfig(otlp_endpoint=f"127.0.0.1:{collector[1]}"))
    c.start()
    yield c
    c.stop()


async def _collect(address: str, **kwargs: object) -> list[gateway_pb2.GenerateResponse]:
    prompt, messages = kwargs.pop("prompt", None), kwargs.pop("messages", None)
    request = build_request(prompt, RequestOptions(**kwargs), messages=messages)  # type: ignore[arg-type]
    async with GatewayClient(address) as client:
        return [m async for m in client.generate(request)]


def _story(tag: str) -> str:
    return f"[{tag}] " + STORY * 3


# -- traces ---------------------------------------------------------------------------------


def test_one_trace_per_request_with_every_phase(
    cluster: LocalCluster, collector: tuple[Collector, int]
) -> None:
    rid = f"trace-{uuid.uuid4().hex[:8]}"
    prompt = _story(rid) + "What does the keeper write down?"
    msgs = asyncio.run(
        _collect(
            cluster.gateway_address,
            messages=[("user", prompt)],
            max_tokens=12,
            ignore_eos=True,
            request_id=rid,
        )
    )
    final = msgs[-1]
    assert final.finished and final.usage.completion_tokens == 12
    spans = collector[0].wait_for(rid, PHASES, timeout=30.0)

    # Exactly one trace carries this request, and one root.
    tagged = [s for s in collector[0].spans if s.attributes.get("pdserve.request_id") == rid]
    assert len({s.trace_id for s in tagged}) == 1
    (root,) = [s for s in spans if s.name == "gateway.generate"]
    assert final.trace_id == root.trace_id and root.parent_id == ""
    by_name = {s.name: s for s in spans}
    assert set(PHASES) <= set(by_name)

    # Every phase is a direct child of the root, exported by the process that ran it.
    for name in PHASES[1:]:
        span = by_name[name]
        assert span.parent_id == root.span_id, name
        assert span.service == SERVICE_OF[name], (name, span.service)
        assert root.start <= span.start <= span.end <= root.end + 5_000_000, name
    assert root.service == "pdserve-gateway"
    starts = [by_name[n].start for n in PHASES]
    assert starts == sorted(starts), [
        (n, s - root.start) for n, s in zip(PHASES, starts, strict=True)
    ]

    # Attributes: request, tenant, token counts, workers, finish reason, status.
    a = root.attributes
    assert a["pdserve.tenant"] == "" and a["pdserve.prompt_tokens"] == final.usage.prompt_tokens
    assert a["pdserve.output_tokens"] == 12 and a["pdserve.finish_reason"] == "FINISH_REASON_LENGTH"
    assert a["pdserve.prefill_worker"] == "prefill-0" and a["pdserve.decode_worker"] == "decode-0"
    assert a["rpc.grpc.status_code"] == "OK" and root.status_code != 2  # not ERROR
    kv = by_name["kv.transfer"].attributes
    assert int(kv["kv.bytes"]) > 0 and int(kv["kv.blocks"]) > 0  # type: ignore[call-overload]
    assert kv["kv.backend"] == "nixl" and float(kv["kv.gbps"]) > 0  # type: ignore[arg-type]
    compute = by_name["prefill.compute"].attributes
    assert compute["pdserve.worker_id"] == "prefill-0"
    assert compute["pdserve.prompt_tokens"] == final.usage.prompt_tokens
    assert "pdserve.cached_tokens" in compute
    assert by_name["decode.stream"].attributes["pdserve.output_tokens"] == 12

    # The same timeline reaches the client (`pdserve generate --trace`).
    assert {p.name for p in final.phases} == set(PHASES)
    table = format_timeline(final)
    assert root.trace_id in table and all(n in table for n in PHASES)


# -- metrics --------------------------------------------------------------------------------


def _scrape(port: int | None) -> dict[str, float]:
    assert port is not None, "the service announced no metrics port"
    return scrape(port)


def _port(cluster: LocalCluster, name: str) -> int | None:
    return next(c.metrics_port for c in cluster.children if c.name == name)


def test_histograms_count_every_request(cluster: LocalCluster) -> None:
    before = _scrape(_port(cluster, "gateway"))
    n = 3
    for i in range(n):
        asyncio.run(_collect(cluster.gateway_address, prompt=f"Count to {i + 3}.", max_tokens=4))
    after = _scrape(_port(cluster, "gateway"))

    def grew(name: str) -> float:
        return (family_total(after, name) or 0.0) - (family_total(before, name) or 0.0)

    for name in (
        "pdserve_time_to_first_token_seconds_count",
        "pdserve_e2e_request_latency_seconds_count",
        "pdserve_requests_total",
    ):
        assert grew(name) == n, name
    assert grew("pdserve_inter_token_latency_seconds_count") > 0
    judged = grew("pdserve_goodput_requests_total") + grew("pdserve_slo_violations_total")
    assert judged >= n  # every finished request met both SLOs or counted a miss
    # One model served: every request series carries its name, and only it.
    models = {k.partition("model=")[2].split(",")[0].rstrip("}") for k in after
              if k.startswith("pdserve_time_to_first_token_seconds_count")}  # fmt: skip
    assert len(models) == 1 and models != {"-"}, models
    worker = _scrape(_port(cluster, "prefill-0"))
    assert worker["pdserve_kv_blocks{state=total}"] > 0
    assert 0.0 <= worker["pdserve_kv_block_utilization"] <= 1.0
    assert "pdserve_num_requests_waiting" in worker
    assert worker["pdserve_kv_offload_blocks{state=total}"] == 0  # no tier asked for
    assert worker["pdserve_kv_offload_hit_tokens_total"] == 0
    decode = _scrape(_port(cluster, "decode-0"))
    assert decode["pdserve_kv_transfer_bytes_total"] > 0
    assert decode["pdserve_kv_transfer_seconds_count"] > 0
    assert "pdserve_router_fail_open_total" in after and "pdserve_router_overflow_total" in after


def test_repeated_prompt_raises_prefix_hit_ratio(cluster: LocalCluster) -> None:
    port = _port(cluster, "prefill-0")
    prompt = _story(uuid.uuid4().hex) + "Summarise the logbook."
    asyncio.run(_collect(cluster.gateway_address, prompt=prompt, max_tokens=2))
    first = _scrape(port)
    asyncio.run(_collect(cluster.gateway_address, prompt=prompt, max_tokens=2))
    second = _scrape(port)
    hit = second["pdserve_prefix_cached_tokens_total"] - first["pdserve_prefix_cached_tokens_total"]
    asked = (
        second["pdserve_prefix_prompt_tokens_total"] - first["pdserve_prefix_prompt_tokens_total"]
    )
    assert asked > 0 and hit >= 0.5 * asked, (hit, asked)
    assert second["pdserve_prefix_hit_ratio"] > first["pdserve_prefix_hit_ratio"]


def test_cancelled_request_is_counted(cluster: LocalCluster) -> None:
    gateway = _port(cluster, "gateway")
    probe = start_probe(cluster)
    before = family_total(_scrape(gateway), "pdserve_requests_cancelled_total") or 0.0

    async def cancel_after_two() -> None:
        async with GatewayClient(cluster.gateway_address) as client:
            call = client.generate(
                build_request(
                    "Tell me a long story.", RequestOptions(max_tokens=400, ignore_eos=True)
                )
            )
            seen = 0
            async for msg in call:
                seen += len(msg.token_ids)
                if seen >= 2:
                    call.cancel()
                    break

    asyncio.run(cancel_after_two())
    end = time.monotonic() + 10.0
    # The cancel is counted when the relay ends; the stream slot is given back just after.
    while True:
        after = _scrape(gateway)
        cancelled = family_total(after, "pdserve_requests_cancelled_total") or 0.0
        active = family_total(after, "pdserve_active_streams")
        if cancelled >= before + 1 and active == 0:
            break
        assert time.monotonic() < end, ("the gateway never counted the cancel", after)
        time.sleep(0.1)
    assert cancelled == before + 1
    assert_cluster_clean(probe)

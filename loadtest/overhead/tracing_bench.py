"""Cost of tracing: throughput and TTFT with every request traced vs tracing off.

Lifecycle: start two local clusters side by side (1 prefill + 1 decode each, Redis
placement, KV over NIXL): one exporting every span (sample ratio 1) over OTLP/gRPC to a
real TraceService receiver in this process, one with tracing off (the default no-op
tracer); both serve Prometheus metrics, so only tracing differs. Warm both up, then run
rounds of closed-loop load (`concurrency` clients, each sending its next request when the
last one ends) alternately on each cluster, in ABBA order so drift and noise hit both
alike; only one cluster is loaded at a time, the other idles. Then stop both and do it
again with the clusters started in the other order (start order alone moved throughput
by 10% and more in A/A runs here). Report output tokens/s and TTFT p50 per side and
their ratios (on / off). Flags become `RunSettings` and a `TracingBenchConfig`
(`bench_main`), which writes the report to `--out` as JSON with the run's provenance;
the clusters and the receiver are stopped on every exit path (SIGTERM included).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from loadtest.harness.bench_main import BenchSpec, Progress, run_main
from loadtest.harness.settings import RunSettings
from loadtest.reports.sources import SERVING_STACK
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from services.common.telemetry_config import TelemetryConfig
from services.gateway.client import GatewayClient, RequestOptions, build_request

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (*SERVING_STACK, "loadtest/overhead/tracing_bench.py")

SCHEMA = "pdserve.tracing_bench/1"
TARGET_COST = 0.05
TOPICS = ("tides", "volcanoes", "glaciers", "comets", "coral reefs", "deserts", "rainbows")


progress = Progress("tracing_bench")


@dataclass(frozen=True)
class TracingBenchConfig:
    rounds: int = field(
        default=2, metadata={"help": "rounds per side and start order (2 orders: x2 in all)"}
    )
    round_s: float = field(default=8.0, metadata={"help": "seconds of load per round"})
    concurrency: int = field(default=4, metadata={"help": "closed-loop clients"})
    max_tokens: int = field(default=32, metadata={"help": "output tokens per request"})
    warmup_requests: int = field(default=4, metadata={"help": "unmeasured requests per side"})

    def __post_init__(self) -> None:
        if min(self.rounds, self.round_s, self.concurrency, self.max_tokens) <= 0:
            raise ValueError("rounds, round_s, concurrency and max_tokens must be > 0")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests}")


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC receiver that counts what it is sent (and keeps nothing)."""

    def __init__(self) -> None:
        self.spans = 0
        self._lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.spans += n
        return trace_service_pb2.ExportTraceServiceResponse()


@dataclass
class RoundResult:
    tokens: int
    requests: int
    seconds: float
    ttfts: list[float]


async def _client_loop(
    address: str, deadline: float, seed: int, max_tokens: int, out: RoundResult
) -> None:
    i = seed
    async with GatewayClient(address) as client:
        while time.monotonic() < deadline:
            topic = TOPICS[i % len(TOPICS)]
            prompt = f"Request {i}: explain in a few sentences how {topic} form."
            i += 1
            request = build_request(
                options=RequestOptions(max_tokens=max_tokens, ignore_eos=True),
                messages=[("user", prompt)],
            )
            start = time.monotonic()
            first = None
            async for msg in client.generate(request):
                if first is None and msg.token_ids:
                    first = time.monotonic() - start
                out.tokens += len(msg.token_ids)
            out.requests += 1
            if first is not None:
                out.ttfts.append(first)


async def _round(address: str, cfg: TracingBenchConfig, seed: int) -> RoundResult:
    result = RoundResult(0, 0, 0.0, [])
    start = time.monotonic()
    deadline = start + cfg.round_s
    await asyncio.gather(
        *(
            _client_loop(address, deadline, seed + 1000 * c, cfg.max_tokens, result)
            for c in range(cfg.concurrency)
        )
    )
    result.seconds = time.monotonic() - start
    return result


async def _warm(address: str, n: int) -> None:
    async with GatewayClient(address) as client:
        for i in range(n):
            async for _ in client.generate(
                build_request(f"Warm up {i}.", RequestOptions(max_tokens=8))
            ):
                pass


@dataclass(frozen=True)
class Side:
    output_tokens_per_s: float
    requests: int
    ttft_p50_ms: float
    round_tokens_per_s: list[float]

    @classmethod
    def of(cls, rounds: list[RoundResult]) -> Side:
        tokens = sum(r.tokens for r in rounds)
        seconds = sum(r.seconds for r in rounds)
        ttfts = [t for r in rounds for t in r.ttfts]
        return cls(
            output_tokens_per_s=tokens / seconds if seconds else 0.0,
            requests=sum(r.requests for r in rounds),
            ttft_p50_ms=1000 * statistics.median(ttfts) if ttfts else 0.0,
            round_tokens_per_s=[round(r.tokens / r.seconds, 2) for r in rounds],
        )


async def _measure(on: str, off: str, cfg: TracingBenchConfig) -> dict[str, list[RoundResult]]:
    await asyncio.gather(_warm(on, cfg.warmup_requests), _warm(off, cfg.warmup_requests))
    results: dict[str, list[RoundResult]] = {"on": [], "off": []}
    # ABBA: on, off, off, on, on, off, ... so neither side always goes first.
    order = [("on", "off") if r % 2 == 0 else ("off", "on") for r in range(cfg.rounds)]
    for r, pair in enumerate(order):
        for side in pair:
            address = on if side == "on" else off
            results[side].append(await _round(address, cfg, seed=r * 100_000))
            last = results[side][-1]
            progress(f"round {r + 1}/{cfg.rounds} tracing {side}: "
                     f"{last.tokens / last.seconds:.1f} tok/s")  # fmt: skip
    return results


@dataclass(frozen=True)
class TracingReport:
    schema: str
    settings: RunSettings
    config: TracingBenchConfig
    tracing_on: Side
    tracing_off: Side
    throughput_ratio_on_off: float
    ttft_p50_ratio_on_off: float
    throughput_cost: float
    target_cost: float
    met: bool
    spans_exported: int


def _cluster(settings: RunSettings, telemetry: TelemetryConfig) -> LocalCluster:
    cfg = ClusterConfig(gateway_port=0, num_prefill=1, num_decode=1, placement="redis",
                        model=settings.model, model_cache_dir=settings.model_cache_dir)  # fmt: skip
    return LocalCluster(cfg, telemetry)


def _phase(
    settings: RunSettings, cfg: TracingBenchConfig, otlp_port: int, traced_first: bool
) -> dict[str, list[RoundResult]]:
    """Start both clusters (the traced one first or second), measure, stop them."""
    traced = _cluster(settings, TelemetryConfig(otlp_endpoint=f"127.0.0.1:{otlp_port}"))
    plain = _cluster(settings, TelemetryConfig())
    try:
        for cluster in (traced, plain) if traced_first else (plain, traced):
            cluster.start()
        return asyncio.run(_measure(traced.gateway_address, plain.gateway_address, cfg))
    finally:
        traced.stop()
        plain.stop()


def run(settings: RunSettings, cfg: TracingBenchConfig) -> TracingReport:
    sink = SpanSink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    rounds: dict[str, list[RoundResult]] = {"on": [], "off": []}
    try:
        # The cluster started first ran measurably faster on this host (A/A runs showed it),
        # so each start order gets half the rounds.
        for traced_first in (True, False):
            for side, results in _phase(settings, cfg, port, traced_first).items():
                rounds[side].extend(results)
    finally:
        server.stop(grace=1.0)
    on, off = Side.of(rounds["on"]), Side.of(rounds["off"])
    throughput_ratio = on.output_tokens_per_s / off.output_tokens_per_s
    return TracingReport(
        schema=SCHEMA,
        settings=settings,
        config=cfg,
        tracing_on=on,
        tracing_off=off,
        throughput_ratio_on_off=throughput_ratio,
        ttft_p50_ratio_on_off=on.ttft_p50_ms / off.ttft_p50_ms,
        throughput_cost=1.0 - throughput_ratio,
        target_cost=TARGET_COST,
        met=1.0 - throughput_ratio <= TARGET_COST,
        spans_exported=sink.spans,
    )


def format_table(r: TracingReport) -> str:
    on, off = r.tracing_on, r.tracing_off
    return (
        f"tracing on: {on.output_tokens_per_s:.1f} tok/s, TTFT p50 {on.ttft_p50_ms:.1f} ms; "
        f"off: {off.output_tokens_per_s:.1f} tok/s, TTFT p50 {off.ttft_p50_ms:.1f} ms -> "
        f"throughput on/off {r.throughput_ratio_on_off:.3f}x, TTFT p50 on/off "
        f"{r.ttft_p50_ratio_on_off:.3f}x; cost {100 * r.throughput_cost:.1f}% "
        f"(target <= {100 * r.target_cost:.0f}%: {'met' if r.met else 'NOT met'}); "
        f"{r.spans_exported} spans exported"
    )


SPEC = BenchSpec(
    name="tracing",
    module="loadtest.overhead.tracing_bench",
    description="Cost of tracing: throughput and TTFT with every request traced against "
    "tracing off, on two identical clusters loaded in turn.",
    config=TracingBenchConfig,
    run=run,
    table=format_table,
    settings=("out", "model", "model_cache_dir"),
    measures=MEASURES,
)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())

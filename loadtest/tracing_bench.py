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
their ratios (on / off), write JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from concurrent import futures
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from services.cluster.local_cluster import ClusterConfig, LocalCluster
from services.common.telemetry_config import TelemetryConfig
from services.gateway.client import GatewayClient, build_request

TARGET_COST = 0.05
TOPICS = ("tides", "volcanoes", "glaciers", "comets", "coral reefs", "deserts", "rainbows")


@dataclass(frozen=True)
class BenchConfig:
    rounds: int = 2  # per side and start order (two orders: 4 rounds per side in all)
    round_s: float = 8.0
    concurrency: int = 4
    max_tokens: int = 32
    warmup_requests: int = 4
    out: Path = Path("bench-results/tracing.json")

    def __post_init__(self) -> None:
        if self.rounds <= 0 or self.round_s <= 0 or self.concurrency <= 0:
            raise ValueError("rounds, round_s and concurrency must be > 0")


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
                messages=[("user", prompt)], max_tokens=max_tokens, ignore_eos=True
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


async def _round(address: str, cfg: BenchConfig, seed: int) -> RoundResult:
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
            async for _ in client.generate(build_request(prompt=f"Warm up {i}.", max_tokens=8)):
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


async def _measure(on: str, off: str, cfg: BenchConfig) -> dict[str, list[RoundResult]]:
    await asyncio.gather(_warm(on, cfg.warmup_requests), _warm(off, cfg.warmup_requests))
    results: dict[str, list[RoundResult]] = {"on": [], "off": []}
    # ABBA: on, off, off, on, on, off, ... so neither side always goes first.
    order = [("on", "off") if r % 2 == 0 else ("off", "on") for r in range(cfg.rounds)]
    for r, pair in enumerate(order):
        for side in pair:
            address = on if side == "on" else off
            results[side].append(await _round(address, cfg, seed=r * 100_000))
            print(
                f"round {r + 1}/{cfg.rounds} tracing {side}: "
                f"{results[side][-1].tokens / results[side][-1].seconds:.1f} tok/s",
                flush=True,
            )
    return results


def _cluster(telemetry: TelemetryConfig) -> LocalCluster:
    cfg = ClusterConfig(gateway_port=0, num_prefill=1, num_decode=1, placement="redis")
    return LocalCluster(cfg, telemetry)


def _phase(cfg: BenchConfig, otlp_port: int, traced_first: bool) -> dict[str, list[RoundResult]]:
    """Start both clusters (the traced one first or second), measure, stop them."""
    traced = _cluster(TelemetryConfig(otlp_endpoint=f"127.0.0.1:{otlp_port}"))
    plain = _cluster(TelemetryConfig())
    try:
        for cluster in (traced, plain) if traced_first else (plain, traced):
            cluster.start()
        return asyncio.run(_measure(traced.gateway_address, plain.gateway_address, cfg))
    finally:
        traced.stop()
        plain.stop()


def run(cfg: BenchConfig) -> dict[str, object]:
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
            for side, results in _phase(cfg, port, traced_first).items():
                rounds[side].extend(results)
    finally:
        server.stop(grace=1.0)
    on, off = Side.of(rounds["on"]), Side.of(rounds["off"])
    throughput_ratio = on.output_tokens_per_s / off.output_tokens_per_s
    return {
        "tracing_on": asdict(on),
        "tracing_off": asdict(off),
        "throughput_ratio_on_off": throughput_ratio,
        "ttft_p50_ratio_on_off": on.ttft_p50_ms / off.ttft_p50_ms,
        "throughput_cost": 1.0 - throughput_ratio,
        "target_cost": TARGET_COST,
        "met": 1.0 - throughput_ratio <= TARGET_COST,
        "spans_exported": sink.spans,
        "config": {k: str(v) for k, v in asdict(cfg).items()},
        "finished_unix": time.time(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=BenchConfig.rounds)
    parser.add_argument("--round-s", type=float, default=BenchConfig.round_s)
    parser.add_argument("--concurrency", type=int, default=BenchConfig.concurrency)
    parser.add_argument("--out", type=Path, default=BenchConfig.out)
    args = parser.parse_args(argv)
    cfg = BenchConfig(
        rounds=args.rounds, round_s=args.round_s, concurrency=args.concurrency, out=args.out
    )
    result = run(cfg)
    on, off = result["tracing_on"], result["tracing_off"]
    assert isinstance(on, dict) and isinstance(off, dict)
    cost = 1.0 - float(result["throughput_ratio_on_off"])  # type: ignore[arg-type]
    print(
        f"tracing on: {on['output_tokens_per_s']:.1f} tok/s, TTFT p50 {on['ttft_p50_ms']:.1f} ms; "
        f"off: {off['output_tokens_per_s']:.1f} tok/s, TTFT p50 {off['ttft_p50_ms']:.1f} ms -> "
        f"throughput on/off {result['throughput_ratio_on_off']:.3f}x, TTFT p50 on/off "
        f"{result['ttft_p50_ratio_on_off']:.3f}x; cost {100 * cost:.1f}% "
        f"(target <= {100 * TARGET_COST:.0f}%: {'met' if result['met'] else 'NOT met'}); "
        f"{result['spans_exported']} spans exported"
    )
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

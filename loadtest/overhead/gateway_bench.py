"""Gateway overhead: p50 TTFT through the gateway minus p50 of a direct Prefill call.

Lifecycle (`python -m loadtest.overhead.gateway_bench`): flags become the run's
`RunSettings` and a `GatewayBenchConfig` (`bench_main`). Start a local cluster (1 prefill
+ 1 decode worker, KV over NIXL), warm it up, then alternate the two measurements on the
same prompt so machine noise hits both: (a) a Generate stream through the gateway, timed
to its first message (TTFT), closed at once; (b) a Prefill RPC straight to the same
prefill worker, timed to its reply (its lease is dropped with Abort). The difference of
the medians is what the gateway adds (tokenization, validation, placement, the extra
hop). The cluster is stopped on every exit path (SIGTERM included); the report goes to
`--out` as JSON with the run's provenance.

Fairness on a small host: after token 1 the gateway starts the decode call, which the
client then cancels. Each measurement starts only once both workers are idle again
(polled through their Stats), so neither side is timed against a cancelled stream still
burning a core; and the order within a pair alternates, so neither side always runs
first after the pause.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from engine.model_store import resolve_model_dir
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from loadtest.harness.bench_main import BenchSpec, run_main
from loadtest.harness.settings import RunSettings
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from services.common import request_codec
from services.gateway.client import GatewayClient, RequestOptions, build_request

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (
    "services/gateway",
    "services/router",
    "services/common",
    "loadtest/overhead/gateway_bench.py",
)

SCHEMA = "pdserve.gateway_bench/1"
PLACEMENTS = ("redis", "static")
TARGET_MS = 3.0
PROMPT = "Explain briefly why the sky is blue."


@dataclass(frozen=True)
class GatewayBenchConfig:
    # ~100 ms prefills vary by a few ms: fewer reps leave +-2 ms of noise.
    reps: int = field(default=300, metadata={"help": "measured (gateway, direct) pairs"})
    warmup: int = field(default=5, metadata={"help": "unmeasured pairs first"})
    placement: str = field(default="redis", metadata={"help": "redis or static placement"})

    def __post_init__(self) -> None:
        if self.reps < 1 or self.warmup < 0:
            raise ValueError("reps must be >= 1 and warmup >= 0")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")


@dataclass(frozen=True)
class GatewayReport:
    schema: str
    settings: RunSettings
    config: GatewayBenchConfig
    gateway_ttft_p50_ms: float
    direct_prefill_p50_ms: float
    overhead_p50_ms: float
    overhead_paired_p50_ms: float
    target_ms: float
    met: bool
    reps: int


async def _gateway_ttft(client: GatewayClient) -> float:
    start = time.perf_counter()
    call = client.generate(build_request(PROMPT, RequestOptions(max_tokens=8)))
    async for _ in call:
        break
    elapsed = time.perf_counter() - start
    call.cancel()
    return elapsed


async def _direct_prefill(stub: worker_pb2_grpc.WorkerStub, prompt: list[int]) -> float:
    rid = uuid.uuid4().hex
    spec = RequestSpec(prompt, SamplingParams(max_tokens=8), request_id=rid)
    request = request_codec.prefill_request(spec)
    start = time.perf_counter()
    await stub.Prefill(request)
    elapsed = time.perf_counter() - start
    await stub.Abort(worker_pb2.AbortRequest(request_id=rid))
    return elapsed


async def _until_idle(workers: list[worker_pb2_grpc.WorkerStub], timeout: float = 10.0) -> None:
    """Wait until no worker runs, queues or holds a request (a cancelled stream is gone)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        stats = [await w.Stats(worker_pb2.StatsRequest()) for w in workers]
        if all(s.running == 0 and s.waiting == 0 and s.held_blocks == 0 for s in stats):
            await asyncio.sleep(0.01)  # the workers' own cleanup after the last step
            return
        await asyncio.sleep(0.005)
    raise TimeoutError("workers did not go idle between measurements")


async def _measure(
    cluster: LocalCluster, settings: RunSettings, cfg: GatewayBenchConfig
) -> tuple[list[float], list[float]]:
    """(gateway TTFTs, direct Prefill times) in seconds, one pair per measured rep."""
    prefill = next(c for c in cluster.children if c.name == "prefill-0")
    model_dir = resolve_model_dir(
        settings.model, settings.model_cache_dir.expanduser(), progress=False
    )
    prompt = Tokenizer(model_dir).encode(PROMPT)
    async with (
        GatewayClient(cluster.gateway_address) as client,
        grpc.aio.insecure_channel(prefill.address) as channel,
    ):
        stub = worker_pb2_grpc.WorkerStub(channel)
        workers = [
            worker_pb2_grpc.WorkerStub(grpc.aio.insecure_channel(c.address))
            for c in cluster.children
            if c.name != "gateway" and c.address
        ]
        gw: list[float] = []
        direct: list[float] = []
        for i in range(cfg.warmup + cfg.reps):
            await _until_idle(workers)
            if i % 2:
                d = await _direct_prefill(stub, prompt)
                await _until_idle(workers)
                g = await _gateway_ttft(client)
            else:
                g = await _gateway_ttft(client)
                await _until_idle(workers)
                d = await _direct_prefill(stub, prompt)
            if i >= cfg.warmup:
                gw.append(g)
                direct.append(d)
    return gw, direct


def run(settings: RunSettings, cfg: GatewayBenchConfig) -> GatewayReport:
    cluster = LocalCluster(
        ClusterConfig(gateway_port=0, num_prefill=1, num_decode=1, placement=cfg.placement,
                      model=settings.model, model_cache_dir=settings.model_cache_dir)
    )  # fmt: skip
    try:
        cluster.start()
        gw, direct = asyncio.run(_measure(cluster, settings, cfg))
    finally:
        cluster.stop()
    p50_gw, p50_direct = statistics.median(gw) * 1e3, statistics.median(direct) * 1e3
    # Each rep's pair ran back to back: the median of their differences cancels the slow
    # drift of a shared machine that the difference of two medians still carries.
    paired = statistics.median(g - d for g, d in zip(gw, direct, strict=True)) * 1e3
    return GatewayReport(
        schema=SCHEMA,
        settings=settings,
        config=cfg,
        gateway_ttft_p50_ms=p50_gw,
        direct_prefill_p50_ms=p50_direct,
        overhead_p50_ms=p50_gw - p50_direct,
        overhead_paired_p50_ms=paired,
        target_ms=TARGET_MS,
        met=p50_gw - p50_direct <= TARGET_MS,
        reps=len(gw),
    )


def format_table(r: GatewayReport) -> str:
    return (
        f"gateway TTFT p50 {r.gateway_ttft_p50_ms:.2f} ms, direct Prefill p50 "
        f"{r.direct_prefill_p50_ms:.2f} ms -> gateway overhead {r.overhead_p50_ms:.2f} ms "
        f"(paired-difference median {r.overhead_paired_p50_ms:.2f} ms; target <= "
        f"{r.target_ms} ms: {'met' if r.met else 'NOT met'}; {r.reps} pairs, placement "
        f"{r.config.placement})"
    )


SPEC = BenchSpec(
    name="gateway",
    module="loadtest.overhead.gateway_bench",
    description="Gateway overhead: p50 TTFT through the gateway minus p50 of a direct "
    "Prefill call to the same worker, measured in alternation.",
    config=GatewayBenchConfig,
    run=run,
    table=format_table,
    settings=("out", "model", "model_cache_dir"),
    measures=MEASURES,
)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())

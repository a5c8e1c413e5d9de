"""Gateway overhead: p50 TTFT through the gateway minus p50 of a direct Prefill call.

Lifecycle: start a local cluster (1 prefill + 1 decode worker, KV over NIXL), warm it
up, then alternate the two measurements on the same prompt so machine noise hits both:
(a) a Generate stream through the gateway, timed to its first message (TTFT), closed at
once; (b) a Prefill RPC straight to the same prefill worker, timed to its reply (its
lease is dropped with Abort). The difference of the medians is what the gateway adds
(tokenization, validation, placement, the extra hop). Writes JSON; stops the cluster.

Fairness on a small host: after token 1 the gateway starts the decode call, which the
client then cancels. Each measurement starts only once both workers are idle again
(polled through their Stats), so neither side is timed against a cancelled stream still
burning a core; and the order within a pair alternates, so neither side always runs
first after the pause.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from engine.config import DEFAULT_MODEL_CACHE
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.cluster.local_cluster import ClusterConfig, LocalCluster
from services.common import sampling
from services.gateway.client import GatewayClient, build_request

TARGET_MS = 3.0
PROMPT = "Explain briefly why the sky is blue."


@dataclass(frozen=True)
class BenchConfig:
    reps: int = 300  # ~100 ms prefills vary by a few ms: fewer reps leave +-2 ms of noise
    warmup: int = 5
    out: Path = Path("bench-results/gateway.json")


async def _gateway_ttft(client: GatewayClient) -> float:
    start = time.perf_counter()
    call = client.generate(build_request(prompt=PROMPT, max_tokens=8))
    async for _ in call:
        break
    elapsed = time.perf_counter() - start
    call.cancel()
    return elapsed


async def _direct_prefill(stub: worker_pb2_grpc.WorkerStub, prompt: list[int]) -> float:
    rid = uuid.uuid4().hex
    request = worker_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt,
        sampling=sampling.to_proto(sampling.from_proto(build_request(max_tokens=8).sampling)),
    )  # fmt: skip
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


async def _measure(cluster: LocalCluster, cfg: BenchConfig) -> dict[str, object]:
    prefill = next(c for c in cluster.children if c.name == "prefill-0")
    async with (
        GatewayClient(cluster.gateway_address) as client,
        grpc.aio.insecure_channel(prefill.address) as channel,
    ):
        stub = worker_pb2_grpc.WorkerStub(channel)
        from engine.model_store import resolve_model_dir
        from engine.tokenizer import Tokenizer

        tok = Tokenizer(resolve_model_dir(None, DEFAULT_MODEL_CACHE.expanduser(), progress=False))
        prompt = tok.encode(PROMPT)
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
    p50_gw, p50_direct = statistics.median(gw) * 1e3, statistics.median(direct) * 1e3
    # Each rep's pair ran back to back: the median of their differences cancels the slow
    # drift of a shared machine that the difference of two medians still carries.
    paired = statistics.median(g - d for g, d in zip(gw, direct, strict=True)) * 1e3
    return {
        "gateway_ttft_p50_ms": p50_gw,
        "direct_prefill_p50_ms": p50_direct,
        "overhead_p50_ms": p50_gw - p50_direct,
        "overhead_paired_p50_ms": paired,
        "target_ms": TARGET_MS,
        "met": p50_gw - p50_direct <= TARGET_MS,
        "reps": cfg.reps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=BenchConfig.reps)
    parser.add_argument("--out", type=Path, default=BenchConfig.out)
    parser.add_argument("--placement", default="redis", help="redis (default) or static")
    args = parser.parse_args(argv)
    cfg = BenchConfig(reps=args.reps, out=args.out)
    cluster = LocalCluster(
        ClusterConfig(gateway_port=0, num_prefill=1, num_decode=1, placement=args.placement)
    )
    try:
        cluster.start()
        result = asyncio.run(_measure(cluster, cfg))
    finally:
        cluster.stop()
    result["config"] = {k: str(v) for k, v in asdict(cfg).items()}
    result["placement"] = args.placement
    result["finished_unix"] = time.time()
    print(
        f"gateway TTFT p50 {result['gateway_ttft_p50_ms']:.2f} ms, direct Prefill p50 "
        f"{result['direct_prefill_p50_ms']:.2f} ms -> gateway overhead "
        f"{result['overhead_p50_ms']:.2f} ms (paired-difference median "
        f"{result['overhead_paired_p50_ms']:.2f} ms; target <= {TARGET_MS} ms: "
        f"{'met' if result['met'] else 'NOT met'})"
    )
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

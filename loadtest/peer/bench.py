"""`python -m loadtest.peer.bench`: pdserve's whole P/D stack against llama.cpp's
llama-server on the same host, same weights, same client and workload.

Lifecycle: `main` checks that `loadtest.peer.build` made the server and the GGUF (if
not, it says so, prints the build command and exits 2: this benchmark is optional and
never part of `make test`), collects the run's provenance and loads the tokenizer (for
prompts of known token lengths). `run_peer` then starts llama-server (127.0.0.1, 2
threads, 16 slots with continuous batching) and a pdserve cluster of 1 prefill + 1
decode worker with the gateway's defaults, one core and one torch thread per worker
(`LocalCluster`), both up for the whole run; sends each a few unmeasured requests;
and runs `rounds` paired rounds: in each, every point (1 stream, 16 streams: a closed
loop of that many concurrent streams) runs on one server while the other idles, then on
the other with the same prompts, who goes first alternating from round to round.
Every request goes through `http_client` (`/v1/completions`, streamed, greedy,
`ignore_eos`, 128 tokens). At 1 stream, pdserve's decode step time is sampled from its
workers' load signals meanwhile (`step_probe`) and the point runs once more over the
gateway's gRPC API (`--grpc-breakdown`), so the report can say where the inter-token gap
goes. Results are rewritten after every round (`report.write_outputs`: peer.json,
peer.md under `--out-dir`), so an interrupted run keeps what it measured; both servers
stop at the end, or on any error.

About 25 minutes on the 2-core development host with the defaults (3 rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.model_store import resolve_model_dir
from loadtest.harness.bench import load_synth, now_iso
from loadtest.harness.metrics import Slo, summarize
from loadtest.harness.request_spec import BenchRequest
from loadtest.harness.runner import Pace, run_point
from loadtest.harness.settings import RunSettings
from loadtest.peer.build import PeerBuildConfig, PeerPaths
from loadtest.peer.config import PeerBenchConfig
from loadtest.peer.http_client import run_closed
from loadtest.peer.llama_server import LlamaServer, LlamaServerSpec, server_command
from loadtest.peer.report import (
    LLAMA,
    PDSERVE,
    SERVERS,
    GapSample,
    PeerResults,
    PointStats,
    median,
    point_stats,
    write_outputs,
)
from loadtest.peer.step_probe import StepProbe, decode_step_ms
from loadtest.peer.workload import peer_requests
from loadtest.reports.provenance import Provenance, collect_provenance
from loadtest.reports.sources import SERVING_STACK
from loadtest.workloads.prompt_text import TextSynth
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from services.common.config import add_config_args, config_from_args

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (*SERVING_STACK, "loadtest/peer", "loadtest/harness", "loadtest/workloads")

WARMUP_STREAM = 10_000  # request stream of the warm-up prompts (apart from the rounds')
GRPC_STREAM = 5_000  # offset of the gRPC breakdown's prompts (no cache hit on the HTTP run's)
PDSERVE_CLUSTER = (
    "1 prefill + 1 decode worker, each pinned to its own core with 1 torch thread, "
    "the gateway's defaults (conditional disaggregation, elastic roles), dtype auto "
    "(the workers' default)"
)


def cluster_config(settings: RunSettings, cfg: PeerBenchConfig) -> ClusterConfig:
    return ClusterConfig(
        num_prefill=1,
        num_decode=1,
        gateway_port=0,
        http_port=0,
        worker_threads=1,
        pin_workers=True,
        placement="redis",
        model=settings.model,
        model_cache_dir=settings.model_cache_dir,
        dtype=cfg.pdserve_dtype,
        gateway_args=cfg.pdserve_gateway_args,
    )


def cluster_words(cfg: PeerBenchConfig) -> str:
    """What the cluster was, in words, for the report."""
    words = PDSERVE_CLUSTER
    if cfg.pdserve_dtype is not None:
        words = words.replace("dtype auto", f"dtype {cfg.pdserve_dtype.value}")
    if cfg.pdserve_gateway_args:
        words += f", gateway flags `{cfg.pdserve_gateway_args}`"
    return words


@dataclass(frozen=True)
class Endpoints:
    llama_url: str
    pdserve_url: str  # the gateway's OpenAI HTTP API
    pdserve_grpc: str  # the gateway's gRPC address
    redis_url: str  # the cluster's Redis, where the workers publish their signals

    def url(self, server: str) -> str:
        return self.pdserve_url if server == PDSERVE else self.llama_url


def round_order(round_: int) -> tuple[str, ...]:
    """Who runs each point first alternates by round, so a drift of the shared host's
    speed falls on both servers alike."""
    return SERVERS if round_ % 2 == 0 else SERVERS[::-1]


def point_stream(round_: int, streams: int) -> int:
    """The prompts' seed of one point of one round: new prompts for every point."""
    return 100 * (round_ + 1) + streams


class _Run:
    """One run's state: where the servers are, what to send, and the results."""

    def __init__(self, cfg: PeerBenchConfig, ends: Endpoints, synth: TextSynth,
                 results: PeerResults, provenance: Provenance) -> None:  # fmt: skip
        self.cfg = cfg
        self.ends = ends
        self.synth = synth
        self.results = results
        self.provenance = provenance
        # The current point's pdserve step time and servers' own per-token time.
        self._steps: dict[str, float | None] = {}
        self._own_ms: dict[str, float | None] = {}

    def requests(self, n: int, stream: int) -> list[BenchRequest]:
        cfg = self.cfg
        return peer_requests(self.synth, n, cfg.prompt_tokens, cfg.output_tokens, stream)

    async def warm_up(self) -> None:
        n = self.cfg.warmup_requests
        if not n:
            return
        for server in SERVERS:
            requests = self.requests(n, WARMUP_STREAM)
            await run_closed(self.ends.url(server), requests, min(n, 4),
                             self.cfg.request_timeout_s, f"warm-up {server}", False)  # fmt: skip

    async def point(self, server: str, streams: int, round_: int, first: bool) -> PointStats:
        """One server runs one point; at 1 stream, pdserve's step time is sampled."""
        requests = self.requests(self.cfg.requests_at(streams), point_stream(round_, streams))
        label = f"round {round_ + 1} {server} x{streams}"
        sampled = server == PDSERVE and streams == 1
        probe = StepProbe(self.ends.redis_url).start() if sampled else None
        cfg = self.cfg
        try:
            run = await run_closed(self.ends.url(server), requests, streams,
                                   cfg.request_timeout_s, label, cfg.progress)  # fmt: skip
        finally:
            samples = probe.stop() if probe is not None else []
        stats = point_stats(server, streams, round_, first, run.records)
        self._steps[server] = decode_step_ms(samples)
        self._own_ms[server] = median(run.ms_per_token)
        return stats

    async def grpc_tpot(self, round_: int) -> float | None:
        """pdserve's 1-stream TPOT p50 over the gateway's gRPC API (other prompts)."""
        if not self.cfg.grpc_breakdown:
            return None
        requests = self.requests(self.cfg.requests_at(1), GRPC_STREAM + point_stream(round_, 1))
        pace = Pace("closed", concurrency=1, duration_s=3600.0,
                    request_timeout_s=self.cfg.request_timeout_s, progress=self.cfg.progress,
                    label=f"round {round_ + 1} pdserve gRPC x1")  # fmt: skip
        records = await run_point(self.ends.pdserve_grpc, requests, pace)
        return summarize(records, Slo()).tpot_ms.p50

    async def round(self, round_: int) -> None:
        for streams in self.cfg.stream_list:
            self._steps.clear()
            self._own_ms.clear()
            got: dict[str, PointStats] = {}
            for i, server in enumerate(round_order(round_)):
                got[server] = await self.point(server, streams, round_, i == 0)
                self.results.rounds.append(got[server])
            if streams == 1:
                self.results.gaps.append(GapSample(
                    round=round_,
                    pdserve_tpot_http=got[PDSERVE].tpot_p50_ms,
                    pdserve_itl_http=got[PDSERVE].itl_p50_ms,
                    pdserve_tpot_grpc=await self.grpc_tpot(round_),
                    pdserve_decode_step=self._steps.get(PDSERVE),
                    llama_tpot=got[LLAMA].tpot_p50_ms,
                    llama_itl=got[LLAMA].itl_p50_ms,
                    llama_ms_per_token=self._own_ms.get(LLAMA),
                ))  # fmt: skip
        write_outputs(self.results, self.provenance)

    async def all_rounds(self) -> None:
        await self.warm_up()
        for r in range(self.cfg.rounds):
            await self.round(r)


def run_peer(
    cfg: PeerBenchConfig, spec: LlamaServerSpec, settings: RunSettings, version: str
) -> Path:
    """Both servers up, the rounds, the report; returns the markdown's path."""
    provenance = collect_provenance(measures=MEASURES)
    llama = LlamaServer(spec, cfg.out_dir / "llama-server.log")
    cluster = LocalCluster(cluster_config(settings, cfg))
    results = PeerResults(created=now_iso(), config=cfg, llama_server=[],
                          llama_cpp_python_version=version,
                          pdserve_cluster=cluster_words(cfg))  # fmt: skip
    try:
        llama_url = llama.start(cfg.startup_timeout_s)  # first: before any thread here
        results.llama_server = server_command(spec, llama.port)
        print(f"peer: llama-server up at {llama_url}", file=sys.stderr)
        synth = load_synth(settings)
        grpc_address = cluster.start()
        assert cluster.redis is not None  # placement redis
        ends = Endpoints(llama_url, f"http://{cluster.http_address}", grpc_address,
                         cluster.redis.url)  # fmt: skip
        print(f"peer: pdserve up at {ends.pdserve_url}", file=sys.stderr)
        asyncio.run(_Run(cfg, ends, synth, results, provenance).all_rounds())
    finally:
        cluster.stop()
        llama.stop()
    return write_outputs(results, provenance)


def missing_message(missing: Sequence[Path]) -> str:
    return (
        "peer benchmark: llama.cpp's server is not built here (missing: "
        + ", ".join(str(p) for p in missing)
        + "). Build it once (about half an hour on 2 cores; downloads llama-cpp-python's "
        "source distribution with pip and needs cmake and a C++ compiler), then rerun:\n"
        "  pip install -e '.[peer]' && python -m loadtest.peer.build"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.peer.bench", description=(__doc__ or "").splitlines()[0]
    )
    add_config_args(parser, PeerBenchConfig)
    add_config_args(parser, PeerBuildConfig, exclude=("build_jobs", "build_nice"))
    add_config_args(parser, RunSettings, exclude=("out", "seed"))
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(PeerBenchConfig, args)
        build = config_from_args(PeerBuildConfig, args)
        settings = config_from_args(RunSettings, args)
    except ValueError as exc:
        parser.error(str(exc))
    paths = PeerPaths.of(build)
    binary = cfg.llama_server or paths.server
    gguf = cfg.gguf
    if gguf is None:
        model_dir = resolve_model_dir(settings.model, settings.model_cache_dir.expanduser())
        gguf = paths.gguf(model_dir)
    missing = [p for p in (binary, gguf) if not p.is_file()]
    if missing:
        print(missing_message(missing), file=sys.stderr)
        return 2
    spec = LlamaServerSpec(binary, gguf, cfg.llama_threads, cfg.llama_slots,
                           cfg.llama_ctx_per_slot, cfg.llama_extra_args)  # fmt: skip
    summary = run_peer(cfg, spec, settings, build.llama_cpp_python_version)
    print(summary.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

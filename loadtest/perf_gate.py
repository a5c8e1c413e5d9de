"""`python -m loadtest.perf_gate` (`make perf-gate`, part of `make test`): a few of the
ratio benchmarks, a few minutes in all on two cores, each held to a floor far below what
it measures, so that a large regression fails CI and a noisy host does not.

Lifecycle: `run` measures, in one process and one run,
- the engine's decode throughput against transformers' on the same requests, at batch 1
  and 16 (`loadtest.engine.bench.run_phase` on `ENGINE_PLANS`: short outputs, no
  continuous-batching or float32 side), in the dtype `pdserve up` picks on this host;
- NIXL against a single-thread memcpy for one 8,192-token import, contiguous and
  scattered, and the median one-block import (`loadtest.transfer.bench.run` on one
  size), whose bytes are verified and whose leases must all come back.
Each figure is checked against its `Floor`; the result (provenance, the digests of what
it measures, every figure and verdict) goes to bench-results/perf_gate.json, and the
exit status is 1 when a floor is missed, a byte is wrong or a lease strands.

The floors sit at about half of what the development host (2 cores, no native bf16, so
its engine computes in float32) measured when they were set, the lowest of the hosts
that have run these benchmarks (docs/loadtest.md, "Performance gate"): a change that
halves a ratio fails; smaller regressions are the full benchmarks' to find. The fused
bf16 decode kernel runs only where the CPU has native bf16, so only the engine figures
there gate it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.model_spec import ModelSpec
from engine.model_store import resolve_model_dir
from engine.precision import resolve_dtype
from loadtest.engine.bench import HfModels, run_phase
from loadtest.engine.bench_config import EngineBenchConfig
from loadtest.engine.sides import load_hf_model
from loadtest.engine.workload import PhasePlan
from loadtest.harness.bench_main import BenchSpec, Progress, run_main
from loadtest.harness.settings import RunSettings
from loadtest.harness.target import TargetResult, target_rows
from loadtest.transfer import bench as transfer_bench
from loadtest.transfer.config import TransferBenchConfig

SCHEMA = "pdserve.perf_gate/1"
#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (
    "engine",
    "kvtransfer",
    "loadtest/engine/bench.py",
    "loadtest/engine/bench_config.py",
    "loadtest/engine/bench_report.py",
    "loadtest/engine/sides.py",
    "loadtest/engine/workload.py",
    "loadtest/transfer",
    "loadtest/perf_gate.py",
)
progress = Progress("perf_gate")


@dataclass(frozen=True)
class Floor:
    """The bound one figure must keep."""

    name: str
    comparison: str  # ">=" for a ratio, "<=" for a latency
    bound: float
    measured_when_set: float  # on the development host, the run that set the bound

    def check(self, measured: float) -> TargetResult:
        context = f"{self.measured_when_set:g} when the floor was set"
        return TargetResult.check(self.name, measured, self.comparison, self.bound, context)


#: The engine's workload: batch 1 and 16 of the engine benchmark's seeded requests,
#: with short outputs (a minute or two on two cores).
ENGINE_PLANS = (
    PhasePlan(1, 2, (16, 256), (32, 64)),
    PhasePlan(16, 16, (16, 256), (32, 64)),
)
FLOORS: dict[str, Floor] = {
    f.name: f
    for f in (
        Floor("engine/transformers @ batch 1", ">=", 0.6, 1.21),
        Floor("engine/transformers @ batch 16", ">=", 0.95, 1.90),
        Floor("nixl/memcpy @8192 contig", ">=", 0.25, 0.52),
        Floor("nixl/memcpy @8192 scatter", ">=", 0.25, 0.53),
        Floor("nixl one-block median ms", "<=", 5.0, 2.14),
    )
}


@dataclass(frozen=True)
class GateConfig:
    engine: bool = field(default=True, metadata={"help": "gate the engine against transformers"})
    transfer: bool = field(default=True, metadata={"help": "gate NIXL against memcpy"})


@dataclass(frozen=True)
class EnginePoint:
    batch_size: int
    pdserve_tokens_per_s: float
    transformers_tokens_per_s: float
    ratio: float
    greedy_agreement: float


@dataclass(frozen=True)
class GateReport:
    schema: str
    wall_s: float
    dtype: str
    engine: list[EnginePoint]
    transfer_verified: bool  # every byte read matched the exporter's
    transfer_leases_clean: bool  # every lease granted was released, none expired
    targets: list[TargetResult]
    passed: bool


def measure_engine(settings: RunSettings) -> tuple[str, list[EnginePoint]]:
    """pdserve against transformers on `ENGINE_PLANS`, one thread (a worker's)."""
    cfg = EngineBenchConfig(threads=1, fp32_baseline=False, hf_continuous=False)
    torch.set_num_threads(cfg.threads)
    model_dir = resolve_model_dir(None, settings.model_cache_dir.expanduser(), progress=True)
    dtype = resolve_dtype(cfg.dtype, torch.device("cpu"))
    hf = HfModels(static=load_hf_model(model_dir, dtype), paged=None)
    vocab = ModelSpec.from_dir(model_dir).vocab_size
    points = []
    for plan in ENGINE_PLANS:
        result, _ = run_phase(settings, cfg, plan, hf, vocab)
        points.append(
            EnginePoint(
                result.batch_size,
                result.pdserve.tokens_per_s,
                result.transformers.tokens_per_s,
                result.ratio,
                result.greedy_agreement,
            )
        )
    return str(dtype).removeprefix("torch."), points


def measure_transfer(settings: RunSettings) -> tuple[list[TargetResult], bool, bool]:
    """The transfer benchmark's 8,192-token figures (after a 2,048-token size, which
    warms the exporter and the copy paths: alone, the first size read a third low),
    verified and clean."""
    cfg = TransferBenchConfig(tokens="2048,8192", reps=5, tcp_reps=2, overhead_reps=100)
    report = transfer_bench.run(settings, cfg)
    return report.targets, report.verified, report.leases_clean


def run(settings: RunSettings, cfg: GateConfig) -> GateReport:
    t0 = time.perf_counter()
    figures: dict[str, float] = {}
    dtype, points = "", list[EnginePoint]()
    if cfg.engine:
        dtype, points = measure_engine(settings)
        figures |= {f"engine/transformers @ batch {p.batch_size}": p.ratio for p in points}
    verified = clean = True
    if cfg.transfer:
        measured, verified, clean = measure_transfer(settings)
        figures |= {t.name: t.measured for t in measured if t.name in FLOORS}
    targets = [FLOORS[name].check(value) for name, value in figures.items()]
    passed = verified and clean and all(t.met for t in targets)
    return GateReport(SCHEMA, time.perf_counter() - t0, dtype, points, verified, clean,
                      targets, passed)  # fmt: skip


def format_table(report: GateReport) -> str:
    lines = [f"performance gate ({report.wall_s:.0f}s, engine in {report.dtype or '-'})"]
    lines += target_rows(report.targets)
    if not (report.transfer_verified and report.transfer_leases_clean):
        lines.append("KV transfer: a byte differed or a lease stranded")
    lines.append("PASSED" if report.passed else "FAILED: a floor was missed")
    return "\n".join(lines)


SPEC = BenchSpec(
    name="perf_gate",
    module="loadtest.perf_gate",
    description="A few ratio benchmarks held to floors far below their results: CI's "
    "check that nothing got twice as slow.",
    config=GateConfig,
    run=run,
    table=format_table,
    settings=("out", "seed", "model_cache_dir"),
    measures=MEASURES,
    verdict=lambda report: report.passed,
)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(SPEC, argv)


if __name__ == "__main__":
    raise SystemExit(main())

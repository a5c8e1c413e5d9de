"""Batch invariance's cost and effect end to end in float32: the engine with it on (the
tiled linear kernel, attention by rows) against it off (oneDNN, SDPA): `python -m
loadtest.engine.tiled_bench` (about 20 minutes on two cores).

Why: `batch_invariant` on makes a request's bits independent of its batch (issue 42,
`engine.invariance`); the issue's target is throughput with it at least 0.9x of the
engine without it at batch 1, 8 and 32. This measures exactly that, and checks the
property it buys on the same engines.

What it runs, per phase of the engine benchmark's preset (`loadtest.engine.workload`:
batch 1, 8 and 32, seeded requests with log-uniform prompt and output lengths, greedy,
EOS ignored): a float32 engine with `batch_invariant off` (oneDNN's packed products and
SDPA, the fastest) and one with `batch_invariant on` (the tiled kernel and
`engine.row_attention`), each warmed up, then
`--rounds` paired rounds (the two back to back, in alternating order, since this
machine is shared and noisy). It
reports each side's output tokens per second (median over rounds, and best) and the
median of the rounds' ratios.

And the property: on each engine, every request of the batch-8 phase alone, with its
token log-probabilities, against the same request while the phase's others run:
whether every log-probability is the same float (`bit_identical`), per side.

The JSON (`--out`) carries the commit, time and host.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import BatchInvariance, EngineConfig
from engine.engine import LLMEngine
from engine.precision import DType
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from loadtest.engine.roofline_bench import Target
from loadtest.engine.sides import drive_engine
from loadtest.engine.workload import PRESETS, EngineRequest, PhasePlan, make_workload
from loadtest.reports.bench_cli import BenchCli, bench_main

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (
    "engine",
    "loadtest/engine/tiled_bench.py",
    "loadtest/engine/sides.py",
    "loadtest/engine/workload.py",
)

SCHEMA = "pdserve.tiled_bench/1"
SIDES = (BatchInvariance.OFF, BatchInvariance.ON)
_RUNS = itertools.count()
#: The issue's floor: tiled throughput over the default's at each batch size.
TARGET = 0.9


@dataclass(frozen=True)
class TiledBenchConfig:
    preset: str = field(default="short", metadata={"help": "the engine benchmark's preset"})
    rounds: int = field(default=3, metadata={"help": "paired rounds per batch size"})
    threads: int = field(default=1, metadata={"help": "torch threads of each engine"})
    kv_cache_bytes: int = field(default=1 << 30, metadata={"help": "each engine's KV pool"})
    max_num_batched_tokens: int = field(default=512, metadata={"help": "step token budget"})
    seed: int = field(default=0, metadata={"help": "the workload's seed"})

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {', '.join(sorted(PRESETS))}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")


@dataclass(frozen=True)
class PhaseSpeed:
    batch_size: int
    requests: int
    output_tokens: int
    default_tps: list[float]  # per round, tokens per second
    tiled_tps: list[float]
    ratio_median: float  # median over rounds of tiled / default
    ratio_best: float  # best tiled over best default
    meets_target: bool


@dataclass(frozen=True)
class Invariance:
    side: str  # batch_invariant off or on
    logprobs: int  # how many were compared
    bit_identical: bool
    differing: int


@dataclass
class TiledBenchReport:
    schema: str
    config: TiledBenchConfig
    target: float = TARGET
    phases: list[PhaseSpeed] = field(default_factory=list)
    invariance: list[Invariance] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)


def targets(report: TiledBenchReport) -> list[Target]:
    """The throughput floor at each batch size, and no differing log-probability."""
    out = [
        Target(f"invariant / off throughput, batch {p.batch_size}", p.ratio_median, ">=",
               report.target, p.meets_target,
               f"median of {len(p.tiled_tps)} paired rounds, float32")
        for p in report.phases
    ]  # fmt: skip
    for inv in report.invariance:
        if inv.side == BatchInvariance.ON.value:
            out.append(Target("invariant: log-probabilities that differ alone vs batched",
                              inv.differing, "<=", 0, inv.bit_identical,
                              f"of {inv.logprobs}, the batch-8 phase's requests"))  # fmt: skip
    return out


def engine(cfg: TiledBenchConfig, side: BatchInvariance, batch_size: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            dtype=DType.FLOAT32,
            batch_invariant=side,
            kv_cache_bytes=cfg.kv_cache_bytes,
            max_num_seqs=batch_size,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            num_threads=cfg.threads,
        )
    )


def timed(eng: LLMEngine, requests: Sequence[EngineRequest]) -> float:
    """Output tokens per second of one run of `requests`."""
    start = time.perf_counter()
    outputs, _ = drive_engine(eng, requests)
    return sum(len(o) for o in outputs) / (time.perf_counter() - start)


def phase_speed(cfg: TiledBenchConfig, plan: PhasePlan, vocab: int) -> PhaseSpeed:
    requests = make_workload(plan, vocab, cfg.seed)
    engines = {k: engine(cfg, k, plan.batch_size) for k in SIDES}
    for eng in engines.values():  # warm-up: compiles the tiles, fills the allocator
        drive_engine(eng, requests[:1])
    tps: dict[BatchInvariance, list[float]] = {k: [] for k in SIDES}
    for r in range(cfg.rounds):
        for k in SIDES if r % 2 == 0 else SIDES[::-1]:
            tps[k].append(timed(engines[k], requests))
            print(f"batch {plan.batch_size} round {r} {k.value}: {tps[k][-1]:.1f} tok/s",
                  flush=True)  # fmt: skip
    base, tiled = tps[BatchInvariance.OFF], tps[BatchInvariance.ON]
    median = statistics.median(t / b for t, b in zip(tiled, base, strict=True))
    return PhaseSpeed(
        plan.batch_size, len(requests), sum(r.max_tokens for r in requests), base, tiled,
        median, max(tiled) / max(base), median >= TARGET,
    )  # fmt: skip


def logprobs(eng: LLMEngine, requests: Sequence[EngineRequest]) -> list[list[float]]:
    """Each request's token log-probabilities, the requests run together under a cache
    salt of their own: a prefix-cache hit on an earlier run would reuse that run's KV
    and hide a difference in the prefill."""
    salt = f"run-{next(_RUNS)}"
    ids = [
        eng.add_request(RequestSpec(list(r.prompt), SamplingParams(
            max_tokens=r.max_tokens, ignore_eos=True, logprobs=0), cache_salt=salt))
        for r in requests
    ]  # fmt: skip
    got: dict[str, list[float]] = {i: [] for i in ids}
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id] += [lp.chosen.logprob for lp in out.logprobs]
    return [got[i] for i in ids]


def invariance(cfg: TiledBenchConfig, plan: PhasePlan, vocab: int) -> list[Invariance]:
    """Per side: every request of the phase alone, then all together."""
    requests = make_workload(plan, vocab, cfg.seed)
    out = []
    for side in SIDES:
        eng = engine(cfg, side, plan.batch_size)
        alone = [logprobs(eng, [r])[0] for r in requests]
        together = logprobs(eng, requests)
        pairs = [(a, b) for one, many in zip(alone, together, strict=True)
                 for a, b in zip(one, many, strict=True)]  # fmt: skip
        differing = sum(a != b for a, b in pairs)
        out.append(Invariance(side.value, len(pairs), differing == 0, differing))
    return out


def run(cfg: TiledBenchConfig) -> TiledBenchReport:
    report = TiledBenchReport(SCHEMA, cfg)
    vocab = engine(cfg, BatchInvariance.OFF, 1).tokenizer.vocab_size
    for plan in PRESETS[cfg.preset]:
        report.phases.append(phase_speed(cfg, plan, vocab))
    plan = max(PRESETS[cfg.preset], key=lambda p: p.batch_size if p.batch_size <= 8 else 0)
    report.invariance = invariance(cfg, plan, vocab)
    report.targets = targets(report)
    return report


def format_table(report: TiledBenchReport) -> str:
    lines = ["float32 engine, batch_invariant on (tiled) over off (oneDNN), output tokens/s"]
    for p in report.phases:
        verdict = "meets" if p.meets_target else "MISSES"
        lines.append(
            f"batch {p.batch_size:3d}: off {statistics.median(p.default_tps):7.1f}  on "
            f"{statistics.median(p.tiled_tps):7.1f}  ratio median {p.ratio_median:.2f}x "
            f"(best {p.ratio_best:.2f}x) {verdict} >= {report.target}x"
        )
    for inv in report.invariance:
        lines.append(f"{inv.side:3s}: {inv.differing} of {inv.logprobs} log-probabilities "
                     "differ alone vs batched")  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    cli = BenchCli(
        __doc__ or "",
        TiledBenchConfig,
        Path("bench-results/tiled.json"),
        run,
        format_table,
        (),
        measures=MEASURES,
    )
    return bench_main(cli, argv)


if __name__ == "__main__":
    sys.exit(main())

"""KV memory benchmark: what an 8-bit cache holds and costs, and what the offload tier saves.

Lifecycle of one run (`python -m loadtest.engine.kv_bench --out F`, in `make bench`), one
torch thread by default, the engine's compute dtype `auto`:

1. capacity: the blocks one `--capacity-bytes` budget holds for each cache dtype
   (float32, bfloat16, int8, fp8_e4m3), from the same layout arithmetic the engine sizes
   its pool with, and the 8-bit caches' ratios to bfloat16 and float32;
2. throughput: the engine benchmark's batch-32 workload (32 requests, prompts 16-1,024
   and outputs 16-256 tokens, log-uniform, seeded) through a fresh engine per cache
   dtype, each in a process of its own, in `--reps` rounds whose order rotates
   (unquantized, int8, fp8; then int8, fp8, unquantized; ...); the target's ratio is the
   best round's output tokens/s against the unquantized cache's best round, and each
   round's ratio to the unquantized run of that round, with their median, is kept as a
   cross-check;
3. offload: a 4,000-token prompt's time to first token when its prefix was evicted
   from a pool that holds one such prompt and a tenth more, once recomputed (no tier)
   and once copied
   back from a tier 4x the pool, each after the same eviction (a second, unrelated
   4,000-token prompt), best of `--reps`.

The targets are issue 21's. Ratios are taken within the run, so a noisy host moves both
sides of each.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.kv_layout import KvLayout, blocks_for_budget
from engine.model_spec import ModelSpec
from engine.model_store import resolve_model_dir
from engine.precision import KvCacheDType, kv_storage_dtype
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from loadtest.engine.sides import drive_engine
from loadtest.engine.workload import FIRST_REGULAR_ID, PhasePlan, make_workload, warmup_workload
from loadtest.harness.target import TargetResult, target_rows
from loadtest.reports.provenance import collect_provenance
from loadtest.reports.result_file import write_result

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (
    "engine",
    "loadtest/engine/kv_bench.py",
    "loadtest/engine/sides.py",
    "loadtest/engine/workload.py",
)

SCHEMA = "pdserve.kv_bench/1"
CPU = torch.device("cpu")
BLOCK_SIZE = EngineConfig().block_size  # the engines' default
THROUGHPUT_PLAN = PhasePlan(32, 32)
CACHE_DTYPES = (KvCacheDType.AUTO, KvCacheDType.INT8, KvCacheDType.FP8_E4M3)
OFFLOAD_PROMPT_TOKENS = 4000
OFFLOAD_TIER_FACTOR = 4
TARGET_VS_BF16, TARGET_VS_FP32 = 1.9, 3.5
TARGET_THROUGHPUT = 0.9
TARGET_TTFT = 0.3
RUN_TIMEOUT_S = 1800  # one side of one round; a run takes about a minute


@dataclass(frozen=True)
class CapacityRow:
    cache: str
    stored_dtype: str
    bytes_per_block: int
    blocks: int
    vs_bfloat16: float
    vs_float32: float


@dataclass(frozen=True)
class ThroughputRow:
    cache: str
    rounds_tokens_per_s: list[float]
    tokens_per_s: float  # best round
    vs_unquantized: float  # best round against the unquantized side's best: the target
    round_ratios: list[float]  # each round against the unquantized run of that round
    median_round_ratio: float  # a cross-check less moved by one side's lucky round


@dataclass(frozen=True)
class OffloadResult:
    prompt_tokens: int
    pool_blocks: int
    tier_blocks: int
    recompute_ttft_s: list[float]
    tier_ttft_s: list[float]
    restored_blocks: int
    ttft_ratio: float  # best tier / best recompute


@dataclass
class KvBenchReport:
    schema: str
    threads: int
    compute_dtype: str
    capacity_bytes: int
    capacity: list[CapacityRow] = field(default_factory=list)
    throughput: list[ThroughputRow] = field(default_factory=list)
    offload: OffloadResult | None = None
    targets: list[TargetResult] = field(default_factory=list)
    targets_met: bool = False


def measure_capacity(spec: ModelSpec, budget: int) -> list[CapacityRow]:
    """Blocks per budget for every cache dtype, from the engine's own sizing."""
    kinds = [("float32", torch.float32), ("bfloat16", torch.bfloat16),
             ("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn)]  # fmt: skip
    layouts = {name: KvLayout.from_spec(spec, d, BLOCK_SIZE, CPU) for name, d in kinds}
    blocks = {name: blocks_for_budget(lay, budget) for name, lay in layouts.items()}
    return [
        CapacityRow(name, layouts[name].dtype, layouts[name].bytes_per_block, blocks[name],
                    blocks[name] / blocks["bfloat16"], blocks[name] / blocks["float32"])
        for name, _ in kinds
    ]  # fmt: skip


def _engine(model: str, threads: int, **over: object) -> LLMEngine:
    settings: dict[str, object] = {"model": model, "num_threads": threads,
                                   "max_num_batched_tokens": 512}  # fmt: skip
    settings.update(over)
    return LLMEngine(EngineConfig(**settings))  # type: ignore[arg-type]


def _throughput_once(model: str, threads: int, kind: KvCacheDType, seed: int) -> float:
    """One side of one round, in a process of its own: output tokens/s of the batch-32
    workload through a fresh engine with cache `kind`, after a one-request warmup."""
    torch.set_num_threads(threads)
    vocab = ModelSpec.from_dir(Path(model)).vocab_size
    work = make_workload(THROUGHPUT_PLAN, vocab, seed)
    engine = _engine(
        model, threads, kv_cache_bytes=2 << 30,
        max_num_seqs=THROUGHPUT_PLAN.batch_size, kv_cache_dtype=kind,
    )  # fmt: skip
    drive_engine(engine, warmup_workload(1, vocab, seed))
    start = time.perf_counter()
    outputs, _ = drive_engine(engine, work)
    elapsed = time.perf_counter() - start
    if [len(o) for o in outputs] != [r.max_tokens for r in work]:
        raise RuntimeError("a request got other than its requested tokens")
    return sum(r.max_tokens for r in work) / elapsed


def _child(send: Connection, fn: Callable[..., float], args: tuple[object, ...]) -> None:
    try:
        send.send((True, fn(*args)))
    except BaseException as exc:  # sent back as text: the parent raises RuntimeError
        send.send((False, f"{type(exc).__name__}: {exc}"))


def run_isolated(fn: Callable[..., float], args: tuple[object, ...], timeout_s: float) -> float:
    """`fn(*args)` in a fresh spawned process; its result, or RuntimeError if it raised,
    died or ran past `timeout_s` (then it is killed: nothing is left running)."""
    spawn = multiprocessing.get_context("spawn")
    recv, send = spawn.Pipe(duplex=False)
    proc = spawn.Process(target=_child, args=(send, fn, args), daemon=True)
    proc.start()
    send.close()  # the child holds the only writer: its death reads as EOF
    try:
        if not recv.poll(timeout_s):
            raise RuntimeError(f"{fn.__name__} ran past {timeout_s} s")
        ok, value = recv.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"{fn.__name__} died (exit code {proc.exitcode})") from None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
    if not ok:
        raise RuntimeError(f"{fn.__name__} failed: {value}")
    return float(value)


def round_order(rnd: int) -> list[KvCacheDType]:
    """The sides of round `rnd`, rotated by one each round so no side always runs first."""
    shift = rnd % len(CACHE_DTYPES)
    return list(CACHE_DTYPES[shift:] + CACHE_DTYPES[:shift])


def measure_throughput(model: str, threads: int, reps: int, seed: int) -> list[ThroughputRow]:
    """`reps` rounds of every cache dtype, each run in a fresh spawned process.

    Why a process per run: measured in one process, throughput fell run by run (the
    first engine of a process ran about 10% faster than later ones), so a fixed order
    favoured whichever side came first. A fresh process per run, in an order rotated
    each round, gives every side the same conditions."""
    rounds: dict[KvCacheDType, list[float]] = {k: [] for k in CACHE_DTYPES}
    for rnd in range(reps):
        for kind in round_order(rnd):
            tps = run_isolated(_throughput_once, (model, threads, kind, seed), RUN_TIMEOUT_S)
            rounds[kind].append(tps)
            print(f"  round {rnd + 1} {kind.value:9s} {tps:7.1f} tok/s", flush=True)
    base = rounds[KvCacheDType.AUTO]
    rows = []
    for kind, runs in rounds.items():
        paired = [x / u for x, u in zip(runs, base, strict=True)]
        rows.append(ThroughputRow(kind.value, [round(x, 2) for x in runs], max(runs),
                                  max(runs) / max(base), [round(r, 3) for r in paired],
                                  float(np.median(paired))))  # fmt: skip
    return rows


def offload_pool_blocks(tokens: int) -> int:
    """A pool that holds one prompt of `tokens` and a tenth more: the second evicts most
    of the first."""
    blocks = -(-tokens // BLOCK_SIZE)
    return blocks + blocks // 10 + 2


def _ttft(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds until the prompt's first token: with max_tokens 1, until it is done."""
    start = time.perf_counter()
    engine.add_request(RequestSpec(prompt, SamplingParams(max_tokens=1)))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def measure_offload(
    model: str, threads: int, reps: int, seed: int, tokens: int = OFFLOAD_PROMPT_TOKENS
) -> OffloadResult:
    spec = ModelSpec.from_dir(Path(model))
    vocab = spec.vocab_size
    rng = np.random.default_rng([seed, tokens])
    hot, evictor = (
        [int(t) for t in rng.integers(FIRST_REGULAR_ID, vocab, tokens)] for _ in range(2)
    )
    pool = offload_pool_blocks(tokens)
    # The engines' own layout (cache dtype auto: the compute dtype), without loading one.
    layout = KvLayout.from_spec(spec, EngineConfig().torch_dtype, BLOCK_SIZE, CPU)
    tier_bytes = OFFLOAD_TIER_FACTOR * pool * layout.bytes_per_block
    times: dict[bool, list[float]] = {False: [], True: []}
    restored = 0
    for _ in range(reps):
        for with_tier in (False, True):
            engine = _engine(model, threads, num_kv_blocks=pool,
                             kv_offload_bytes=tier_bytes if with_tier else 0)  # fmt: skip
            _ttft(engine, hot)
            _ttft(engine, evictor)  # evicts `hot`'s cached blocks (into the tier, if any)
            times[with_tier].append(_ttft(engine, hot))
            if with_tier:
                restored = engine.stats().offload_restored_total
            del engine
            gc.collect()
    return OffloadResult(
        prompt_tokens=tokens,
        pool_blocks=pool,
        tier_blocks=OFFLOAD_TIER_FACTOR * pool,
        recompute_ttft_s=[round(t, 4) for t in times[False]],
        tier_ttft_s=[round(t, 4) for t in times[True]],
        restored_blocks=restored,
        ttft_ratio=min(times[True]) / min(times[False]),
    )


def evaluate(report: KvBenchReport) -> list[TargetResult]:
    targets = []
    for c in report.capacity:
        if c.cache in ("int8", "fp8_e4m3"):
            targets += [
                TargetResult.check(f"{c.cache} blocks / bf16", c.vs_bfloat16, ">=", TARGET_VS_BF16),
                TargetResult.check(f"{c.cache} blocks / fp32", c.vs_float32, ">=", TARGET_VS_FP32),
            ]
    base = next((t for t in report.throughput if t.cache == "auto"), None)
    for t in report.throughput:
        if t.cache != "auto" and base is not None:
            targets.append(TargetResult.check(
                f"{t.cache} tok/s @32 / unquantized", t.vs_unquantized, ">=",
                TARGET_THROUGHPUT, f"unquantized {base.tokens_per_s:.1f} tok/s"))  # fmt: skip
    if report.offload is not None:
        o = report.offload
        targets.append(TargetResult.check(
            "TTFT from tier / recomputed", o.ttft_ratio, "<=", TARGET_TTFT,
            f"recomputed {min(o.recompute_ttft_s):.3f} s"))  # fmt: skip
    return targets


def run(
    threads: int, reps: int, seed: int, capacity_bytes: int, parts: Sequence[str]
) -> KvBenchReport:
    torch.set_num_threads(threads)
    cfg = EngineConfig()
    model = str(resolve_model_dir(cfg.model, cfg.model_cache_dir.expanduser()))
    spec = ModelSpec.from_dir(Path(model))
    compute = kv_storage_dtype(KvCacheDType.AUTO, cfg.torch_dtype)
    report = KvBenchReport(SCHEMA, threads, str(compute).removeprefix("torch."), capacity_bytes)
    if "capacity" in parts:
        report.capacity = measure_capacity(spec, capacity_bytes)
    if "throughput" in parts:
        report.throughput = measure_throughput(model, threads, reps, seed)
    if "offload" in parts:
        report.offload = measure_offload(model, threads, reps, seed)
    report.targets = evaluate(report)
    report.targets_met = bool(report.targets) and all(t.met for t in report.targets)
    return report


def format_table(report: KvBenchReport) -> str:
    rows = [f"KV benchmark, compute {report.compute_dtype}, {report.threads} thread(s)"]
    if report.capacity:
        rows.append(f"capacity of {report.capacity_bytes / 2**20:.0f} MiB:")
        rows += [
            f"  {c.cache:9s} {c.bytes_per_block:>8} B/block {c.blocks:>6} blocks "
            f"{c.vs_bfloat16:5.2f}x bf16 {c.vs_float32:5.2f}x fp32"
            for c in report.capacity
        ]
    if report.throughput:
        rows.append(f"throughput at batch {THROUGHPUT_PLAN.batch_size} (best of rounds):")
        rows += [f"  {t.cache:9s} {t.tokens_per_s:7.1f} tok/s {t.vs_unquantized:5.2f}x  "
                 f"rounds {t.rounds_tokens_per_s}, round by round {t.round_ratios} "
                 f"(median {t.median_round_ratio:.2f}x)" for t in report.throughput]  # fmt: skip
    if report.offload is not None:
        o = report.offload
        rows.append(
            f"offload: {o.prompt_tokens}-token prompt evicted from a {o.pool_blocks}-block pool; "
            f"TTFT recomputed {o.recompute_ttft_s} s, from a {o.tier_blocks}-block tier "
            f"{o.tier_ttft_s} s ({o.restored_blocks} blocks restored): {o.ttft_ratio:.3f}x"
        )
    rows.append("targets:")
    rows += target_rows(report.targets)
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/kv.json"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--capacity-bytes", type=int, default=256 << 20)
    parser.add_argument("--parts", default="capacity,throughput,offload",
                        help="comma-separated subset of capacity,throughput,offload")  # fmt: skip
    args = parser.parse_args(argv)
    provenance = collect_provenance(sys.argv, MEASURES)
    report = run(args.threads, args.reps, args.seed, args.capacity_bytes, args.parts.split(","))
    write_result(args.out, report, provenance)
    print(format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

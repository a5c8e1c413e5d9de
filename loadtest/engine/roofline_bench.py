"""Roofline benchmark: the engine's prefill and decode as fractions of this machine's roofs.

Lifecycle of one run (`python -m loadtest.engine.roofline_bench --out F`, in
`make bench`): with one torch thread by default (one core, as the engine's workers run),
and for each precision in turn (float32, bfloat16, int8 weights):

1. the roofs, measured now (`machine_roof`): the read bandwidth over every core (once
   per run), the precision's peak GEMM rate at the engine's thread count, and from
   them the roof at 256 rows (a prefill chunk, layers only) and at 1, 16 and 64 rows (a
   decode step, LM head included): min(peak, the time to read every weight once),
   never below the model's own projections' rate, which is reported beside it;
2. a fresh engine prefills one 256-token prompt (one chunk: the shape the target is
   set at) and one 1,024-token prompt in 256-token chunks, where attention, which
   torch's CPU SDPA runs at a quarter of the GEMM rate, is 14% of the FLOPs (GFLOPS =
   the projections' and attention's FLOPs over the wall time until the first token);
3. the same engine decodes batches of 1, 16 and 64 requests; only steps in which every
   request of the batch decodes are timed (GFLOPS per step, as in 2);
4. the fractions: prefill / the 256-row roof, decode / the roof at its row count, and
   batch-1 decode against the bandwidth bound (every projection weight and the LM head
   read once per step, at the precision's width, over the read bandwidth). Each roof
   is an upper bound, so a fraction above 1 is a measurement error, not a win.

The targets are the bf16 ones of the issue that asked for this benchmark. Every later
engine change is judged by these fractions, not by absolute tokens/s on a shared host.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.decode_roof import linear_flops, linear_weight_bytes
from engine.engine import LLMEngine
from engine.model_spec import ModelSpec
from engine.precision import DType, WeightQuant, resolve_dtype
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from loadtest.engine.machine_roof import Roof, peak_gflops, read_bandwidth, roof
from loadtest.reports.provenance import collect_provenance
from loadtest.reports.result_file import write_result

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (
    "engine",
    "loadtest/engine/roofline_bench.py",
    "loadtest/engine/machine_roof.py",
)

SCHEMA = "roofline_bench/v1"
PREFILL_LENGTHS = (256, 1024)
CHUNK = 256
DECODE_BATCHES = (1, 16, 64)
DECODE_PROMPT = 16
TIMED_STEPS = 8


@dataclass(frozen=True)
class Precision:
    name: str
    dtype: DType
    quantization: WeightQuant
    weight_bytes: float  # bytes per weight element as stored (int8: scales are negligible)
    gemm_dtype: str  # the kernel dtype its roof is measured in


PRECISIONS = (
    Precision("float32", DType.FLOAT32, WeightQuant.NONE, 4, "float32"),
    Precision("bfloat16", DType.BFLOAT16, WeightQuant.NONE, 2, "bfloat16"),
    Precision("int8", DType.AUTO, WeightQuant.INT8, 1, "int8"),
)


@dataclass
class DecodePoint:
    batch: int
    step_ms: float
    gflops: float
    roof_gflops: float
    fraction: float
    kernel_gflops: float = 0.0  # the model's projections through pdserve's kernel
    memory_bound_gflops: float = 0.0


@dataclass
class PrefillPoint:
    tokens: int
    tokens_per_s: float
    gflops: float
    roof_gflops: float
    fraction: float
    kernel_gflops: float = 0.0


@dataclass
class PrecisionResult:
    name: str
    compute_dtype: str
    peak_gflops: float = 0.0  # the best large GEMM's rate, the compute roof
    prefill: list[PrefillPoint] = field(default_factory=list)
    decode: list[DecodePoint] = field(default_factory=list)
    bandwidth_bound_ms: float = 0.0  # batch-1 step streaming every weight once
    bandwidth_fraction: float = 0.0  # bound / measured batch-1 step


@dataclass
class Target:
    name: str
    measured: float
    comparison: str
    threshold: float
    met: bool
    context: str


@dataclass
class RooflineReport:
    schema: str = SCHEMA
    threads: int = 1
    bandwidth_gb_s: float = 0.0
    precisions: list[PrecisionResult] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    note: str = (
        "fractions of roofs measured in the same run: a roof is min(the dtype's peak GEMM "
        "rate at the engine's thread count, the rate of a step that only reads its weights "
        "at the read bandwidth of every core), never below the model's own projections' "
        "rate (kernel GFLOPS); GFLOPS count 2 per multiply-add of the projections, the LM "
        "head where it runs, and attention"
    )


def attention_flops(spec: ModelSpec, query_positions: Sequence[int]) -> float:
    """QK^T and PV FLOPs of queries at the given positions (each sees position + 1 keys)."""
    width = spec.num_heads * spec.head_dim
    return 4.0 * width * spec.num_layers * sum(p + 1 for p in query_positions)


def _random_prompt(length: int, seed: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (length,), generator=gen).tolist()


def measure_prefill(engine: LLMEngine, tokens: int, seed: int) -> tuple[float, float]:
    """(tokens/s, GFLOPS) of one `tokens`-long prompt until its first token."""
    spec = engine.spec
    prompt = _random_prompt(tokens, seed, spec.vocab_size)
    start = time.perf_counter()
    engine.add_request(RequestSpec(prompt, SamplingParams(max_tokens=1)))
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - start
    flops = linear_flops(spec, tokens, lm_head=False) + attention_flops(spec, range(tokens))
    flops += linear_flops(spec, 1, lm_head=True) - linear_flops(spec, 1, lm_head=False)
    return tokens / wall, flops / wall / 1e9


def measure_decode(engine: LLMEngine, batch: int, seed: int) -> tuple[float, float]:
    """(median step seconds, GFLOPS) of decode steps in which all `batch` requests decode."""
    spec = engine.spec
    params = SamplingParams(max_tokens=TIMED_STEPS + 4, temperature=0.0, ignore_eos=True)
    ids = [
        engine.add_request(
            RequestSpec(_random_prompt(DECODE_PROMPT, seed + i, spec.vocab_size), params)
        )
        for i in range(batch)
    ]
    steps: list[tuple[float, float]] = []  # (seconds, flops)
    while engine.has_unfinished():
        reqs = [engine.requests.get(rid) for rid in ids]
        decoding = all(r is not None and r.output_token_ids for r in reqs)
        positions = [r.num_tokens - 1 for r in reqs if r is not None]
        start = time.perf_counter()
        engine.step()
        if decoding and len(steps) < TIMED_STEPS:
            flops = linear_flops(spec, batch, lm_head=True) + attention_flops(spec, positions)
            steps.append((time.perf_counter() - start, flops))
    step_s = statistics.median(s for s, _ in steps)
    return step_s, statistics.fmean(f for _, f in steps) / step_s / 1e9


def measure_precision(p: Precision, bw_gb_s: float, seed: int) -> PrecisionResult:
    config = EngineConfig(dtype=p.dtype, quantization=p.quantization,
                          max_num_batched_tokens=CHUNK, max_num_seqs=max(DECODE_BATCHES),
                          kv_cache_bytes=512 << 20)  # fmt: skip
    engine = LLMEngine(config)
    spec = engine.spec
    measure_prefill(engine, CHUNK, seed + 99)  # warm-up: first calls pay oneDNN's setup
    compute = str(resolve_dtype(p.dtype, torch.device("cpu"))).removeprefix("torch.")
    peak = peak_gflops(p.gemm_dtype)
    result = PrecisionResult(name=p.name, compute_dtype=compute, peak_gflops=peak)

    def roof_at(rows: int, *, lm_head: bool) -> Roof:
        return roof(spec, p.gemm_dtype, rows, p.weight_bytes, bw_gb_s, peak, lm_head=lm_head)

    chunk = roof_at(CHUNK, lm_head=False)
    for tokens in PREFILL_LENGTHS:
        tokens_s, gflops = measure_prefill(engine, tokens, seed + tokens)
        result.prefill.append(PrefillPoint(tokens, tokens_s, gflops, chunk.gflops,
                                           gflops / chunk.gflops, chunk.kernel_gflops))  # fmt: skip
    for batch in DECODE_BATCHES:
        step_s, gflops = measure_decode(engine, batch, seed + 1000 * batch)
        at = roof_at(batch, lm_head=True)
        result.decode.append(DecodePoint(batch, step_s * 1000, gflops, at.gflops,
                                         gflops / at.gflops, at.kernel_gflops,
                                         at.memory_bound_gflops))  # fmt: skip
        if batch == 1:
            bound_s = linear_weight_bytes(spec, p.weight_bytes) / (bw_gb_s * 1e9)
            result.bandwidth_bound_ms = bound_s * 1000
            result.bandwidth_fraction = bound_s / step_s
    del engine
    gc.collect()
    return result


def targets(results: list[PrecisionResult]) -> list[Target]:
    """The bf16 targets: prefill >= 0.6 of its GEMM roof, decode at batch 16 >= 0.5,
    batch-1 decode >= 0.7 of the bandwidth bound."""
    bf16 = next((r for r in results if r.name == "bfloat16"), None)
    if bf16 is None:
        return []
    b16 = next(d for d in bf16.decode if d.batch == 16)
    chunk = next(p for p in bf16.prefill if p.tokens == CHUNK)
    rows = [
        ("bf16 prefill / bf16 GEMM roof", chunk.fraction, 0.6, "a 256-token prompt"),
        ("bf16 decode b16 / bf16 GEMM roof", b16.fraction, 0.5, "16-row roof"),
        (
            "bf16 decode b1 / bandwidth bound",
            bf16.bandwidth_fraction,
            0.7,
            "read bandwidth, every core",
        ),
    ]
    return [Target(name, value, ">=", want, value >= want, ctx) for name, value, want, ctx in rows]


def run(threads: int, seed: int, names: Sequence[str]) -> RooflineReport:
    torch.set_num_threads(threads)
    bw = read_bandwidth()
    report = RooflineReport(threads=threads, bandwidth_gb_s=bw)
    for p in PRECISIONS:
        if p.name in names:
            report.precisions.append(measure_precision(p, bw, seed))
    report.targets = targets(report.precisions)
    return report


def format_table(report: RooflineReport) -> str:
    lines = [f"threads {report.threads}, read bandwidth {report.bandwidth_gb_s:.1f} GB/s"]
    for r in report.precisions:
        lines.append(f"{r.name} (computes in {r.compute_dtype}; peak {r.peak_gflops:.0f} GFLOPS)")
        for p in r.prefill:
            lines.append(
                f"{'':9s} prefill {p.tokens:<5d} {p.tokens_per_s:6.0f} tok/s {p.gflops:6.1f} "
                f"GFLOPS = {p.fraction:.2f} of {p.roof_gflops:.0f} (kernel {p.kernel_gflops:.0f})"
            )
        for d in r.decode:
            lines.append(
                f"{'':9s} decode b{d.batch:<3d} {d.step_ms:7.1f} ms/step {d.gflops:6.1f} GFLOPS"
                f" = {d.fraction:.2f} of {d.roof_gflops:.0f} (kernel {d.kernel_gflops:.0f})"
            )
        lines.append(
            f"{'':9s} b1 bandwidth bound {r.bandwidth_bound_ms:.1f} ms: "
            f"{r.bandwidth_fraction:.2f} of it"
        )
    for t in report.targets:
        state = "met" if t.met else "NOT MET"
        lines.append(f"target {t.name}: {t.measured:.2f} {t.comparison} {t.threshold} {state}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/roofline.json"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--precisions", default=",".join(p.name for p in PRECISIONS),
        help="comma-separated subset of float32,bfloat16,int8",
    )  # fmt: skip
    args = parser.parse_args(argv)
    provenance = collect_provenance(sys.argv, MEASURES)
    report = run(args.threads, args.seed, args.precisions.split(","))
    write_result(args.out, report, provenance)
    print(format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

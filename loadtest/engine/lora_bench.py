"""Multi-LoRA benchmark: one batch mixing four adapters against the same batch on the
base model (`make bench`).

Lifecycle of one run (`python -m loadtest.engine.lora_bench --out F`): random adapters in
PEFT's format are written to a temporary directory, four of each shape (`SHAPES`: PEFT's
default for Llama, q and v at rank 8; and the heaviest common kind, every projection at
rank 16); one engine on the default model (its default compute dtype) gets that
`--lora-dir`; then `--reps` interleaved rounds run the same batch of `--batch` requests
(the parity chat prompts, greedy, `--max-tokens` each, EOS ignored) on the base model,
and spread over the four adapters of each shape in turn (each step's batch mixes all
four, their rows interleaved). Each side's tokens/s is output tokens over the round's
wall time (prefill and decode); the best round of each is kept, beside the median over
rounds of each round's ratio to the base side (the rounds interleave the sides, so each
is a pair), and the median decode step time while the whole batch decodes. The adapters
are loaded before the first round (loading is not what is measured).

The target (issue 24): mixed / base tokens/s >= 0.8 for each shape, both in this run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.adapter_ref import AdapterRef
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.lora import module_shapes
from engine.model_spec import ModelSpec
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from engine.tokenizer import ChatMessage
from loadtest.harness.target import TargetResult, target_rows
from loadtest.reports.provenance import collect_provenance
from loadtest.reports.result_file import write_result
from loadtest.workloads.parity_prompts import CHAT, SHORT

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (
    "engine",
    "loadtest/engine/lora_bench.py",
    "loadtest/workloads/parity_prompts.py",
)

SCHEMA = "pdserve.lora_bench/1"
TARGET = 0.8
MODULES = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
ALL_LINEAR = tuple(m for ms in MODULES.values() for m in ms)


@dataclass(frozen=True)
class Shape:
    """One kind of adapter: the projections it targets and its rank."""

    name: str
    targets: tuple[str, ...]
    rank: int


#: PEFT's default for Llama-family models (q and v, rank 8), and the heaviest common kind
#: (every projection, rank 16).
SHAPES = (Shape("qv-r8", ("q_proj", "v_proj"), 8), Shape("all-linear-r16", ALL_LINEAR, 16))
PER_SHAPE = 4  # adapters of each shape, mixed in one batch


@dataclass
class Side:
    name: str  # "base", or the adapter shape of the mixed batch
    tokens_per_s: float = 0.0  # best round
    step_ms: float = 0.0  # median decode step while the whole batch decodes
    ratio: float = 1.0  # tokens_per_s / the base side's, same run
    # The median over rounds of this side's tokens/s over the base side's in the same
    # round (the rounds interleave the sides, so each round is a pair).
    paired_ratio: float = 1.0
    rounds: list[float] = field(default_factory=list)


@dataclass
class LoraBenchReport:
    schema: str
    compute_dtype: str
    batch: int
    max_tokens: int
    adapters_per_batch: int
    reps: int
    sides: list[Side] = field(default_factory=list)
    targets: list[TargetResult] = field(default_factory=list)


def adapter_names(shape: Shape) -> list[str]:
    return [f"{shape.name}-{i}" for i in range(PER_SHAPE)]


def write_adapter(path: Path, spec: ModelSpec, shape: Shape, gen: torch.Generator) -> None:
    """A random adapter of `shape` in PEFT's layout, B small enough to be a nudge."""
    sizes = module_shapes(spec)
    weights = {}
    for layer in range(spec.num_layers):
        for block, modules in MODULES.items():
            for module in (m for m in modules if m in shape.targets):
                fan_in, fan_out = sizes[module]
                key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                a = torch.randn(shape.rank, fan_in, generator=gen) / fan_in**0.5
                b = torch.randn(fan_out, shape.rank, generator=gen) * 0.01
                weights[f"{key}.lora_A.weight"], weights[f"{key}.lora_B.weight"] = a, b
    path.mkdir(parents=True)
    save_file(weights, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": shape.rank, "lora_alpha": 2 * shape.rank,
              "target_modules": list(shape.targets)}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))


def _prompts(engine: LLMEngine, batch: int) -> list[list[int]]:
    tok = engine.tokenizer
    pool = [tok.encode_chat([ChatMessage("user", c)]) for c in CHAT]
    pool += [tok.encode_chat([ChatMessage("user", s)]) for s in SHORT]
    return [pool[i % len(pool)] for i in range(batch)]


def _round(
    engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None], max_tokens: int
) -> tuple[float, list[float]]:
    """(output tokens/s over the round, decode step times in ms with the batch whole)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [
        engine.add_request(RequestSpec(p, params, adapter=None if a is None else AdapterRef(a)))
        for p, a in zip(prompts, adapters, strict=True)
    ]
    steps: list[float] = []
    tokens = 0
    while engine.has_unfinished():
        decoding = sum(
            1 for rid in ids
            if (r := engine.requests.get(rid)) is not None and r.output_token_ids
        )  # fmt: skip
        t0 = time.perf_counter()
        outs = engine.step()
        if decoding == len(ids):
            steps.append((time.perf_counter() - t0) * 1000)
        tokens += sum(len(o.new_token_ids) for o in outs)
    return tokens / (time.perf_counter() - start), steps


def _engine(root: Path, threads: int) -> LLMEngine:
    """An engine on `root`'s adapters, every one of them resident."""
    probe = LLMEngine(EngineConfig(kv_cache_bytes=16 << 20))
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        for name in adapter_names(shape):
            write_adapter(root / name, probe.spec, shape, gen)
    slots = len(SHAPES) * PER_SHAPE
    return LLMEngine(EngineConfig(kv_cache_bytes=512 << 20, num_threads=threads or None,
                                  lora_dir=str(root), max_loras=slots,
                                  max_num_batched_tokens=1024))  # fmt: skip


def measure(batch: int, max_tokens: int, reps: int, threads: int) -> LoraBenchReport:
    with tempfile.TemporaryDirectory(prefix="pdserve-lora-bench-") as tmp:
        engine = _engine(Path(tmp), threads)
        prompts = _prompts(engine, batch)
        # Each request in turn takes the next adapter: every step mixes all four, their
        # rows interleaved.
        mixes: dict[str, list[str | None]] = {"base": [None] * batch}
        for shape in SHAPES:
            names = adapter_names(shape)
            mixes[shape.name] = [names[i % len(names)] for i in range(batch)]
            _round(engine, prompts[: len(names)], list(names), 2)  # load them, warm up
        sides = {name: Side(name) for name in mixes}
        steps: dict[str, list[float]] = {name: [] for name in mixes}
        for _ in range(reps):
            for name, adapters in mixes.items():
                tps, step_ms = _round(engine, prompts, adapters, max_tokens)
                sides[name].rounds.append(tps)
                steps[name] += step_ms
        dtype = str(engine.config.torch_dtype).removeprefix("torch.")
    for name, side in sides.items():
        side.tokens_per_s = max(side.rounds)
        side.step_ms = statistics.median(steps[name]) if steps[name] else float("nan")
        side.ratio = side.tokens_per_s / sides["base"].tokens_per_s
        pairs = zip(side.rounds, sides["base"].rounds, strict=True)
        side.paired_ratio = statistics.median(mine / base for mine, base in pairs)
    report = LoraBenchReport(SCHEMA, dtype, batch, max_tokens, PER_SHAPE, reps,
                             list(sides.values()))  # fmt: skip
    base = sides["base"].tokens_per_s
    report.targets = [
        TargetResult.check(
            f"{s.name} x{PER_SHAPE} mixed / base tokens/s", s.ratio, ">=", TARGET,
            f"base {base:.1f} tok/s, batch {batch}",
        )
        for s in report.sides
        if s.name != "base"
    ]  # fmt: skip
    return report


def format_table(report: LoraBenchReport) -> str:
    lines = [
        f"multi-LoRA, batch {report.batch}, {report.adapters_per_batch} adapters mixed per "
        f"batch, {report.compute_dtype}"
    ]
    for s in report.sides:
        lines.append(
            f"{s.name:>15}: {s.tokens_per_s:6.1f} tok/s (best of {len(s.rounds)}) = "
            f"{s.ratio:.2f}x (median of paired rounds {s.paired_ratio:.2f}x), decode step "
            f"{s.step_ms:6.1f} ms"
        )
    lines += target_rows(report.targets)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/lora.json"))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    provenance = collect_provenance(sys.argv, MEASURES)
    report = measure(args.batch, args.max_tokens, args.reps, args.threads)
    write_result(args.out, report, provenance)
    print(format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Preemption by swap against preemption by recompute: what a resume costs (`make bench`).

Lifecycle of one run (`python -m loadtest.engine.preemption_bench --out F`): for each
context length in `CONTEXTS`, one engine per mode (`--kv-restore always`: swap; `never`:
recompute) on the default model in its default compute (bfloat16), with a KV pool only a
little larger than the context and an offload tier. Each round, a sheddable request with
a `context`-token prompt decodes a few tokens; then a critical request from another
tenant, nearly the pool's size, is admitted a chunk at a time and preempts it, its
allocations pushing the sheddable's blocks out of the pool (into the tier). Once the
critical request is done, the sheddable one resumes. Its resume time runs from the end
of the step that finished the critical request to the end of the step that gives the
sheddable request its next token: under swap its blocks are copied back, under
recompute its whole context is prefilled again. Rounds alternate the modes (each round
its own cache salt, so nothing is reused across rounds) so drift on this shared host
hits both alike; the report gives the median of each mode's resume times and the median
of the paired rounds' ratios (recompute / swap; above 1: swap is faster), and checks
that the sheddable request's greedy tokens are the same in both modes.

Target (issue 46): greedy output identical either way. The ratios say where swap is
faster; `--kv-restore faster` (the default) measures the same two costs live.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import EngineConfig, KvRestore
from engine.engine import LLMEngine
from engine.priority import Priority
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from loadtest.harness.target import TargetResult, target_rows
from loadtest.reports.provenance import collect_provenance
from loadtest.reports.result_file import write_result
from loadtest.workloads.parity_prompts import long_prompt

#: The source paths these numbers describe (`loadtest.reports.sources`).
MEASURES = ("engine", "loadtest/engine/preemption_bench.py")

CONTEXTS = (512, 1024, 2048)
BLOCK = 16
SPARE_BLOCKS = 20  # pool = the context's blocks + these (a first chunk fits in them)
TOKENS = 16  # the sheddable request's output
BEFORE = 4  # tokens it decodes before the preemption
MODES = {"swap": KvRestore.ALWAYS, "recompute": KvRestore.NEVER}


@dataclass
class ContextResult:
    context: int
    swap_s: list[float] = field(default_factory=list)
    recompute_s: list[float] = field(default_factory=list)
    swap_median_s: float = 0.0
    recompute_median_s: float = 0.0
    paired_ratio: float = 0.0  # median over rounds of recompute / swap
    swapped_tokens: int = 0  # per swap round: tokens copied back
    recomputed_tokens: int = 0  # per recompute round: tokens computed again
    same_tokens: bool = True


@dataclass
class PreemptionReport:
    schema: str = "pdserve.preemption_bench/1"
    rounds: int = 0
    contexts: list[ContextResult] = field(default_factory=list)
    targets: list[TargetResult] = field(default_factory=list)


def _engine(context: int, mode: KvRestore) -> LLMEngine:
    blocks = context // BLOCK + SPARE_BLOCKS
    return LLMEngine(EngineConfig(num_kv_blocks=blocks, kv_offload_bytes=1 << 30,
                                  kv_restore=mode, max_num_batched_tokens=256))  # fmt: skip


def _round(
    engine: LLMEngine, prompt: list[int], other: list[int], salt: str
) -> tuple[float, list[int]]:
    """(resume seconds, the sheddable request's tokens) for one preemption."""
    greedy = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    rid = engine.add_request(RequestSpec(prompt, greedy, cache_salt=salt,
                                         priority=Priority.SHEDDABLE))  # fmt: skip
    tokens: list[int] = []
    while len(tokens) < BEFORE:
        tokens += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    preemptions = engine.stats().num_preemptions
    crit = engine.add_request(RequestSpec(other, SamplingParams(max_tokens=1),
                                          cache_salt=salt + "/other",
                                          priority=Priority.CRITICAL))  # fmt: skip
    resumed_at = None
    resume_s = float("nan")
    while engine.has_unfinished():
        outs = engine.step()
        new = [t for o in outs if o.request_id == rid for t in o.new_token_ids]
        if resumed_at is not None and new and resume_s != resume_s:
            resume_s = time.perf_counter() - resumed_at
        tokens += new
        if any(o.request_id == crit and o.finished for o in outs):
            resumed_at = time.perf_counter()
    if engine.stats().num_preemptions != preemptions + 1:
        raise RuntimeError("the critical request did not preempt the sheddable one")
    return resume_s, tokens


def measure_context(context: int, rounds: int) -> ContextResult:
    engines = {name: _engine(context, mode) for name, mode in MODES.items()}
    text = engines["swap"].tokenizer.encode(long_prompt(40))
    prompt = text[:context]
    other = text[-(context + (SPARE_BLOCKS - 2) * BLOCK) :]  # nearly the whole pool
    result = ContextResult(context)
    outputs: dict[str, list[int]] = {}
    for r in range(rounds):
        order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
        for name in order:
            resume_s, tokens = _round(engines[name], prompt, other, f"round{r}")
            getattr(result, f"{name}_s").append(resume_s)
            result.same_tokens &= outputs.setdefault("tokens", tokens) == tokens
    swap, recompute = engines["swap"].stats(), engines["recompute"].stats()
    result.swapped_tokens = swap.swapped_in_tokens_total // rounds
    result.recomputed_tokens = recompute.recomputed_tokens_total // rounds
    result.swap_median_s = statistics.median(result.swap_s)
    result.recompute_median_s = statistics.median(result.recompute_s)
    result.paired_ratio = statistics.median(
        rc / sw for rc, sw in zip(result.recompute_s, result.swap_s, strict=True)
    )
    return result


def run(rounds: int, contexts: Sequence[int]) -> PreemptionReport:
    report = PreemptionReport(rounds=rounds)
    report.contexts = [measure_context(c, rounds) for c in contexts]
    report.targets = [
        TargetResult.check(
            f"{c.context} tokens: greedy tokens identical, swap and recompute",
            float(c.same_tokens), ">=", 1.0,
            f"resume recompute / swap {c.paired_ratio:.2f}x (median of paired rounds)",
        )
        for c in report.contexts
    ]  # fmt: skip
    return report


def format_table(report: PreemptionReport) -> str:
    lines = [f"resume after preemption, {report.rounds} paired rounds per context"]
    for c in report.contexts:
        lines.append(
            f"{c.context:>5} tokens: swap {c.swap_median_s * 1000:7.1f} ms "
            f"({c.swapped_tokens} tokens copied), recompute {c.recompute_median_s * 1000:7.1f} ms "
            f"({c.recomputed_tokens} tokens computed); recompute / swap {c.paired_ratio:.2f}x; "
            f"same tokens: {c.same_tokens}"
        )
    return "\n".join(lines + target_rows(report.targets))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/preemption.json"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    args = parser.parse_args(argv)
    provenance = collect_provenance(sys.argv, MEASURES)
    report = run(args.rounds, args.contexts)
    write_result(args.out, report, provenance)
    print(format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

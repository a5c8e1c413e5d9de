"""What structured output and logit processing cost per decode step (`make bench`).

Lifecycle of one run (`python -m loadtest.engine.structured_bench --out F`): one engine
on the default model; a batch of 16 requests is prefilled, then decode steps are timed
while all 16 decode, for three batches in turn: plain; half of them constrained by a JSON
schema (grammar masks computed while the model runs, `engine/grammar.py`); half of them
with presence, frequency and repetition penalties plus a logit_bias. Rounds alternate the
three so drift on this shared host hits them alike. The report gives each batch's median
step time and its ratio to the plain batch measured in the same run, and the grammar mask
time per step (llguidance's fill for the 8 constrained rows, timed alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.grammar_mask import MaskJob
from engine.request_spec import RequestSpec
from engine.sampling_params import GuidedKind, GuidedSpec, SamplingParams
from loadtest.reports.provenance import collect_provenance
from loadtest.reports.result_file import write_result

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (
    "engine",
    "loadtest/engine/structured_bench.py",
)

BATCH = 16
STEPS = 12  # timed decode steps per round
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "year": {"type": "integer"},
    },
    "required": ["title", "tags", "year"],
}
PROMPT = "Write a long JSON description of a book you like, with many tags."


@dataclass
class Batch:
    name: str
    step_ms: list[float] = field(default_factory=list)
    median_ms: float = 0.0
    ratio: float = 0.0


@dataclass
class StructuredReport:
    schema: str = "structured_bench/v1"
    batch: int = BATCH
    rounds: int = 0
    batches: list[Batch] = field(default_factory=list)
    mask_ms_per_step: float = 0.0
    note: str = ""


def _params(kind: str, i: int) -> SamplingParams:
    base = SamplingParams(max_tokens=64, temperature=0.8, seed=i, ignore_eos=True)
    if i % 2 or kind == "plain":
        return base
    if kind == "json_schema":
        spec = GuidedSpec(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA))
        return SamplingParams(max_tokens=64, temperature=0.8, seed=i, guided=spec)
    return SamplingParams(
        max_tokens=64, temperature=0.8, seed=i, ignore_eos=True, presence_penalty=0.5,
        frequency_penalty=0.5, repetition_penalty=1.1, logit_bias=((28, -5.0), (30, 2.0)),
    )  # fmt: skip


def _round(engine: LLMEngine, kind: str) -> list[float]:
    """Step times (ms) while all BATCH requests decode."""
    prompt = engine.tokenizer.encode(PROMPT)
    ids = [engine.add_request(RequestSpec(prompt, _params(kind, i))) for i in range(BATCH)]
    times: list[float] = []
    while engine.has_unfinished() and len(times) < STEPS:
        decoding = sum(
            1 for rid in ids
            if (r := engine.requests.get(rid)) is not None and r.output_token_ids
        )  # fmt: skip
        start = time.perf_counter()
        engine.step()
        if decoding == BATCH:
            times.append((time.perf_counter() - start) * 1000)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return times


def _mask_ms(engine: LLMEngine) -> float:
    spec = GuidedSpec(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA))
    grammars = [engine.grammars().matcher(spec) for _ in range(BATCH // 2)]
    times = []
    for _ in range(20):
        start = time.perf_counter()
        MaskJob(grammars, engine.spec.vocab_size).allowed(BATCH, range(BATCH // 2))
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def run(rounds: int) -> StructuredReport:
    engine = LLMEngine(EngineConfig(kv_cache_bytes=256 << 20))
    kinds = ["plain", "json_schema", "penalties"]
    batches = {k: Batch(k) for k in kinds}
    _round(engine, "plain")  # warm-up
    for _ in range(rounds):
        for kind in kinds:
            batches[kind].step_ms += _round(engine, kind)
    for b in batches.values():
        b.median_ms = statistics.median(b.step_ms) if b.step_ms else float("nan")
    plain = batches["plain"].median_ms
    for b in batches.values():
        b.ratio = b.median_ms / plain
    note = "ratio = median decode step time / the plain batch's, same run; 8 of 16 rows each"
    return StructuredReport(rounds=rounds, batches=list(batches.values()),
                            mask_ms_per_step=_mask_ms(engine), note=note)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/structured.json"))
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    provenance = collect_provenance(sys.argv, MEASURES)
    report = run(args.rounds)
    write_result(args.out, report, provenance)
    for b in report.batches:
        steps = len(b.step_ms)
        print(f"{b.name:12s} step {b.median_ms:7.1f} ms  ratio {b.ratio:.2f}x ({steps} steps)")
    print(f"grammar masks for 8 rows: {report.mask_ms_per_step:.2f} ms per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())

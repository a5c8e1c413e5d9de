"""Cache fairness: a tenant's hot system prompt against another tenant's flood (`make bench`).

Lifecycle of one run (`python -m loadtest.engine.cache_fairness_bench --out F`): one
engine per mode on the default model in its default compute (bfloat16), its KV pool cut
to `POOL_BLOCKS` so that the flood overflows it every round. Tenant "hot" sends one
request per round: a shared system prompt (`SYSTEM_TOKENS`, about a quarter of the pool)
and a question of its own. Tenant "flood" sends `FLOOD` prompts per round, each unique
(`FLOOD_TOKENS`), queued with the hot request, which arrives at a varying place among them
(the same places in every mode). Every request generates 2 tokens. Three modes, each
measured in the same run:
- `solo`: the hot tenant alone;
- `fair`: both tenants, each with its own cache salt, as the gateway sends them (the
  prefix cache evicts the tenant holding the most per weight, engine/cache_share.py);
- `shared list`: the same traffic with both tenants' blocks counted as one tenant's, which
  is exactly one least-recently-freed list: how the cache evicted before cache fairness.
The hot tenant's hit rate is its cached prompt tokens over its prompt tokens (the first,
cold round included in every mode). The schedule is deterministic (requests are queued
per round and stepped synchronously), so a hit rate is a count, not a sample; the report
also gives each round's hits and the wall time per mode as context.

Target (issue 46): fair / solo hit rate >= 0.9.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from loadtest.harness.target import TargetResult, target_rows
from loadtest.reports.provenance import collect_provenance
from loadtest.reports.result_file import write_result
from loadtest.workloads.parity_prompts import long_prompt

#: The source paths these numbers describe (`loadtest.reports.sources`).
MEASURES = ("engine", "loadtest/engine/cache_fairness_bench.py")

POOL_BLOCKS = 96  # 1,536 tokens
SYSTEM_TOKENS = 384  # 24 blocks: a quarter of the pool
QUESTION_TOKENS = 24
FLOOD = 8
FLOOD_TOKENS = 256  # 8 x 16 blocks a round: more than the pool
TARGET = 0.9
MODES = ("solo", "fair", "shared list")


@dataclass
class ModeResult:
    mode: str
    hot_prompt_tokens: int = 0
    hot_cached_tokens: int = 0
    hit_rate: float = 0.0
    hits_per_round: list[int] = field(default_factory=list)
    flood_requests: int = 0
    wall_s: float = 0.0


@dataclass
class CacheFairnessReport:
    schema: str = "pdserve.cache_fairness_bench/1"
    rounds: int = 0
    pool_blocks: int = POOL_BLOCKS
    system_tokens: int = SYSTEM_TOKENS
    flood_per_round: int = FLOOD
    flood_tokens: int = FLOOD_TOKENS
    modes: list[ModeResult] = field(default_factory=list)
    fair_vs_solo: float = 0.0
    shared_vs_solo: float = 0.0
    targets: list[TargetResult] = field(default_factory=list)


@dataclass(frozen=True)
class Prompts:
    system: list[int]
    questions: list[list[int]]  # one per round
    floods: list[list[list[int]]]  # per round, FLOOD unique prompts


def _prompts(engine: LLMEngine, rounds: int) -> Prompts:
    """Token lists cut from the parity text: unique per round and request by a leading
    marker token sequence, so no flood prompt shares a block with another."""
    text = engine.tokenizer.encode(long_prompt(12))
    system = text[:SYSTEM_TOKENS]
    vocab = engine.spec.vocab_size

    def unique(key: int, n: int) -> list[int]:
        # A distinct first block, then text: the chained hashes never meet.
        head = [(key * 7919 + i * 104729) % (vocab - 1000) + 500 for i in range(16)]
        return head + text[SYSTEM_TOKENS : SYSTEM_TOKENS + n - 16]

    questions = [unique(10_000 + r, QUESTION_TOKENS) for r in range(rounds)]
    floods = [[unique(r * FLOOD + i, FLOOD_TOKENS) for i in range(FLOOD)] for r in range(rounds)]
    return Prompts(system, questions, floods)


def _fresh_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=POOL_BLOCKS))


def _run_mode(mode: str, prompts: Prompts, rounds: int, engine: LLMEngine) -> ModeResult:
    """One mode's rounds on `engine`, which must be fresh (an empty cache)."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    flood_salt = {"solo": None, "fair": "flood", "shared list": "hot"}[mode]
    result = ModeResult(mode)
    start = time.perf_counter()
    for r in range(rounds):
        hot = RequestSpec(prompts.system + prompts.questions[r], params, cache_salt="hot")
        specs = []
        if flood_salt is not None:
            specs = [RequestSpec(p, params, cache_salt=flood_salt) for p in prompts.floods[r]]
        specs.insert(r % (len(specs) + 1), hot)  # the hot request's place varies by round
        ids = [engine.add_request(s) for s in specs]
        hot_id = ids[specs.index(hot)]
        cached = 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == hot_id and out.finished:
                    cached = out.num_cached_tokens
        result.hits_per_round.append(cached)
        result.hot_prompt_tokens += len(hot.prompt_token_ids)
        result.hot_cached_tokens += cached
        result.flood_requests += len(specs) - 1
    result.wall_s = time.perf_counter() - start
    result.hit_rate = result.hot_cached_tokens / result.hot_prompt_tokens
    return result


def run(rounds: int) -> CacheFairnessReport:
    first = _fresh_engine()  # its tokenizer cuts the prompts; it runs the first mode
    prompts = _prompts(first, rounds)
    report = CacheFairnessReport(rounds=rounds)
    report.modes = [
        _run_mode(mode, prompts, rounds, first if i == 0 else _fresh_engine())
        for i, mode in enumerate(MODES)
    ]
    solo, fair, shared = (m.hit_rate for m in report.modes)
    report.fair_vs_solo = fair / solo if solo else 0.0
    report.shared_vs_solo = shared / solo if solo else 0.0
    report.targets = [
        TargetResult.check(
            "hot tenant's hit rate under a flood / solo", report.fair_vs_solo, ">=", TARGET,
            f"one shared list: {report.shared_vs_solo:.2f}x; solo hit rate {solo:.3f}",
        )
    ]  # fmt: skip
    return report


def format_table(report: CacheFairnessReport) -> str:
    lines = [
        f"hot tenant: {report.system_tokens}-token system prompt; flood: {report.flood_per_round}"
        f" x {report.flood_tokens} unique tokens a round; pool {report.pool_blocks} blocks; "
        f"{report.rounds} rounds"
    ]
    for m in report.modes:
        lines.append(
            f"{m.mode:>12}: hit rate {m.hit_rate:.3f} ({m.hot_cached_tokens}/"
            f"{m.hot_prompt_tokens} tokens), {m.wall_s:.1f} s; hits per round {m.hits_per_round}"
        )
    lines.append(f"fair / solo {report.fair_vs_solo:.2f}x, shared list / solo "
                 f"{report.shared_vs_solo:.2f}x")  # fmt: skip
    return "\n".join(lines + target_rows(report.targets))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/cache_fairness.json"))
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args(argv)
    provenance = collect_provenance(sys.argv, MEASURES)
    report = run(args.rounds)
    write_result(args.out, report, provenance)
    print(format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

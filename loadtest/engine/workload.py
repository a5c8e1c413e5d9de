"""The engine benchmark's workload: per batch size, seeded requests of random token ids.

Lifecycle: `EngineBenchConfig.phases` names one `PhasePlan` per batch size (a preset);
for each, `make_workload(plan, vocab_size, seed)` draws the phase's requests (prompt and
output lengths log-uniform in the plan's ranges, 16-1,024 and 16-256 tokens as in real
traffic) and `warmup_workload` a few short ones for the untimed warm-up. The draws depend
only on (seed, plan), so both sides, and every rerun, get the same requests. Random
regular token ids keep prompts from sharing prefixes, so pdserve's prefix cache gets no
hits it would not get in real traffic; throughput depends only on the lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: Ids below this are SmolLM2's special tokens; prompts draw only regular ones.
FIRST_REGULAR_ID = 17
WARMUP_PROMPT_LEN = 24
WARMUP_OUTPUT_LEN = 4


@dataclass(frozen=True)
class PhasePlan:
    """One batch size's workload: how many requests and their length ranges (inclusive)."""

    batch_size: int
    num_requests: int
    prompt_range: tuple[int, int] = (16, 1024)
    output_range: tuple[int, int] = (16, 256)

    def __post_init__(self) -> None:
        if self.batch_size <= 0 or self.num_requests < self.batch_size:
            raise ValueError(f"need num_requests >= batch_size > 0, got {self}")
        for lo, hi in (self.prompt_range, self.output_range):
            if not 0 < lo <= hi:
                raise ValueError(f"length ranges need 0 < lo <= hi, got {self}")


PRESETS: dict[str, tuple[PhasePlan, ...]] = {
    # Batch 1 runs fewer and shorter requests (the same log-uniform shape, both bounds
    # halved) so that the default run fits in a few minutes on two cores.
    "short": (
        PhasePlan(1, 3, (8, 512), (8, 128)),
        PhasePlan(8, 8),
        PhasePlan(32, 32),
    ),
    "full": (
        PhasePlan(1, 8),
        PhasePlan(8, 32),
        PhasePlan(32, 96),
    ),
    "smoke": (
        PhasePlan(1, 2, (16, 40), (4, 8)),
        PhasePlan(2, 2, (16, 40), (4, 8)),
    ),
}


@dataclass(frozen=True)
class EngineRequest:
    prompt: tuple[int, ...]
    max_tokens: int


def log_uniform(rng: np.random.Generator, lo: int, hi: int, n: int) -> list[int]:
    """`n` integers in [lo, hi] whose logarithm is (about) uniformly distributed."""
    draws = np.exp(rng.uniform(math.log(lo), math.log(hi + 1), n))
    return [min(hi, max(lo, int(v))) for v in draws]


def make_workload(plan: PhasePlan, vocab_size: int, seed: int) -> list[EngineRequest]:
    """The phase's requests, the same for any run with the same seed and plan."""
    rng = np.random.default_rng([seed, plan.batch_size, plan.num_requests])
    prompt_lens = log_uniform(rng, *plan.prompt_range, plan.num_requests)
    output_lens = log_uniform(rng, *plan.output_range, plan.num_requests)
    return [
        EngineRequest(tuple(int(t) for t in rng.integers(FIRST_REGULAR_ID, vocab_size, p)), o)
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]


def warmup_workload(n: int, vocab_size: int, seed: int) -> list[EngineRequest]:
    rng = np.random.default_rng([seed, 0xC0FFEE, n])
    return [
        EngineRequest(
            tuple(int(t) for t in rng.integers(FIRST_REGULAR_ID, vocab_size, WARMUP_PROMPT_LEN)),
            WARMUP_OUTPUT_LEN,
        )
        for _ in range(n)
    ]

"""Settings of the engine benchmark: the preset and the engine's knobs.

Every field is a flag with a `PDSERVE_*` env var (`bench_main`); `--full`, `--smoke`
and `--no-warmup` are shorthands for `--preset full`, `--preset smoke` and
`--warmup false`. The seed, output file and model cache are the run's `RunSettings`.
`bench.run` records the config with `threads` resolved (0 becomes torch's count).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.precision import DType
from loadtest.engine.workload import PRESETS, PhasePlan


@dataclass(frozen=True)
class EngineBenchConfig:
    preset: str = field(
        default="short",
        metadata={"help": "short (minutes), full (tens of minutes) or smoke (tests)"},
    )
    # One thread by default: a worker's default (`--worker-threads 1`), and on this 2-core
    # shared host two threads measured fp32 gaining more from the second core than bf16.
    threads: int = field(default=1, metadata={"help": "torch threads (0: torch's default)"})
    kv_cache_bytes: int = field(default=2 << 30, metadata={"help": "pdserve's KV pool bytes"})
    max_num_batched_tokens: int = field(
        default=512, metadata={"help": "pdserve's token budget per step"}
    )
    warmup: bool = field(default=True, metadata={"help": "untimed warm-up runs on each side"})
    dtype: DType = field(
        default=DType.AUTO,
        metadata={"help": "dtype of pdserve and both transformers sides (auto: pdserve's)"},
    )
    fp32_baseline: bool = field(
        default=True,
        metadata={"help": "also run pdserve in float32 on the same requests (when dtype is not)"},
    )
    hf_continuous: bool = field(
        default=True,
        metadata={"help": "also run transformers' continuous batching (paged cache) side"},
    )

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        object.__setattr__(self, "dtype", DType(self.dtype))
        if self.kv_cache_bytes <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("kv_cache_bytes and max_num_batched_tokens must be > 0")

    @property
    def phases(self) -> tuple[PhasePlan, ...]:
        return PRESETS[self.preset]

"""Settings of the transfer benchmark: prompt sizes and repetitions.

Every field is a flag with a `PDSERVE_*` env var (`bench_main`; `--tokens 512,2048`).
The seed (of the scattered block ids), output file and model cache are the run's
`RunSettings`. `bench.run` records the config with `tcp_reps` resolved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loadtest.harness.settings import parse_ints
from loadtest.transfer.exporter import BLOCK_SIZE

#: Spare blocks beyond the largest transfer, so contiguous runs can start off block 0.
HEADROOM_BLOCKS = 16
#: TCP repetitions when not given: the fallback is slow and its spread small.
DEFAULT_TCP_REPS = 5


@dataclass(frozen=True)
class TransferBenchConfig:
    tokens: str = field(
        default="512,2048,8192", metadata={"help": "prompt sizes in tokens, comma-separated"}
    )
    reps: int = field(default=7, metadata={"help": "timed repetitions per size and pattern"})
    tcp_reps: int | None = field(
        default=None,
        metadata={"help": f"of those, over TCP (default min({DEFAULT_TCP_REPS}, reps))"},
    )
    overhead_reps: int = field(
        default=300, metadata={"help": "timed one-block imports per backend"}
    )
    peer_timeout_s: float = field(
        default=120.0, metadata={"help": "most seconds the exporter process may take to answer"}
    )

    def __post_init__(self) -> None:
        _ = self.token_counts  # parses (and so validates) the sizes
        if self.reps < 1 or not 1 <= self.tcp_rep_count <= self.reps or self.overhead_reps < 1:
            raise ValueError("need reps >= 1, 1 <= tcp_reps <= reps and overhead_reps >= 1")
        if self.peer_timeout_s <= 0:
            raise ValueError(f"peer_timeout_s must be > 0, got {self.peer_timeout_s}")

    @property
    def token_counts(self) -> tuple[int, ...]:
        return parse_ints(self.tokens, "tokens")

    @property
    def tcp_rep_count(self) -> int:
        return min(DEFAULT_TCP_REPS, self.reps) if self.tcp_reps is None else self.tcp_reps

    @property
    def num_blocks(self) -> int:
        return -(-max(self.token_counts) // BLOCK_SIZE) + HEADROOM_BLOCKS

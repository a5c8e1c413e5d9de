"""The noisy-neighbour benchmark's own knobs, on top of the shared flow-control ones
(`loadtest.flow.config`): phase length, each tenant's share, how loud the neighbour is."""

from __future__ import annotations

from dataclasses import dataclass, field

from loadtest.flow.config import FlowBenchConfig


@dataclass(frozen=True)
class FairnessBenchConfig(FlowBenchConfig):
    phase_s: float = field(default=45.0, metadata={"help": "seconds of traffic per phase"})
    share_rate: float | None = field(
        default=None,
        metadata={"help": "each tenant's share (req/s); default: capacity / 3, searched"},
    )
    noisy_factor: float = field(
        default=5.0, metadata={"help": "the noisy tenant A's rate, in shares"}
    )
    backlog_factor: float = field(
        default=2.0, metadata={"help": "every tenant's rate in the backlogged phases, in shares"}
    )
    settle_s: float = field(
        default=5.0, metadata={"help": "idle seconds between phases (queues and signals drain)"}
    )
    isolation_target: float = field(
        default=0.9, metadata={"help": "target: B's and C's attainment, noisy / alone"}
    )
    jain_target: float = field(
        default=0.95, metadata={"help": "target: Jain's index of KV-block-seconds, backlogged"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.phase_s <= 0 or self.settle_s < 0:
            raise ValueError("phase_s must be > 0 and settle_s >= 0")
        if self.share_rate is not None and self.share_rate <= 0:
            raise ValueError(f"share_rate must be > 0, got {self.share_rate}")
        if self.noisy_factor < 1 or self.backlog_factor < 1:
            raise ValueError("noisy_factor and backlog_factor must be >= 1")
        if not 0 < self.isolation_target <= 1 or not 0 < self.jain_target <= 1:
            raise ValueError("isolation_target and jain_target must be in (0, 1]")

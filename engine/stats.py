"""Engine statistics snapshot, shared by the services' Stats RPC and metrics."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from engine.priority import Priority


class ClassCounts(NamedTuple):
    """One count per priority class; index it by a `Priority` or read it by name."""

    sheddable: int = 0
    standard: int = 0
    critical: int = 0

    @classmethod
    def of(cls, priorities: Iterable[Priority]) -> ClassCounts:
        counts = [0] * len(Priority)
        for p in priorities:
            counts[p] += 1
        return cls(*counts)


NO_COUNTS = ClassCounts()  # immutable, so one shared default is safe


@dataclass(frozen=True)
class EngineStats:
    """Counts at one instant. `used_blocks` includes held (exported) and importing blocks;
    free cached blocks count as free. A leak check asserts `used_blocks == 0` when idle.
    The `*_by_class` counts split `waiting`, `running` and `num_preemptions` by class."""

    total_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    held_blocks: int
    importing_blocks: int
    running: int
    waiting: int
    held_requests: int
    importing_requests: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    num_preemptions: int
    kv_bytes_per_token: int
    kv_pool_bytes: int
    block_size: int
    waiting_by_class: ClassCounts = NO_COUNTS
    running_by_class: ClassCounts = NO_COUNTS
    preemptions_by_class: ClassCounts = NO_COUNTS

    @property
    def prefix_hit_ratio(self) -> float:
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )

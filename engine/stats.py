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
    The `*_by_class` counts split `waiting`, `running` and `num_preemptions` by class;
    `waiting_tokens_by_class` is the prefill still owed by the waiting requests and the
    running ones still prefilling (their uncomputed prompt tokens; a preempted request's
    output tokens too, since it recomputes them), never the hand-off states.

    The `*_total` fields only grow from the engine's start, so a rate is the difference of
    two snapshots over the difference of their busy times (`engine/step_meter.py`):
    `prefill_tokens_total` counts tokens computed by prefill chunks (prefix-cache hits
    are not computed; recomputes after a preemption are), `decode_tokens_total` the
    tokens sampled, `decode_steps_total` the steps that ran a decode. `busy_s_total` is
    the wall time of the steps that ran the model; `prefill_busy_s_total` and
    `decode_busy_s_total` that of the steps with a prefill chunk or a decode (a mixed
    step counts in both)."""

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
    waiting_tokens_by_class: ClassCounts = NO_COUNTS
    prefill_tokens_total: int = 0
    prefill_busy_s_total: float = 0.0
    decode_tokens_total: int = 0
    decode_steps_total: int = 0
    decode_busy_s_total: float = 0.0
    busy_s_total: float = 0.0
    # Steps that ran only decodes: their wall time, and the least their reads could take
    # (engine/decode_roof.py); the ratio of the two's rates is the fraction of the roof.
    decode_only_busy_s_total: float = 0.0
    decode_roof_s_total: float = 0.0
    memory_bandwidth_bytes_s: float = 0.0
    # The offload tier (all 0 without one): entries now, its size, prefix tokens it
    # served (within prefix_hit_tokens), blocks spilled into it and restored from it.
    offload_blocks: int = 0
    offload_capacity_blocks: int = 0
    offload_hit_tokens: int = 0
    offload_spilled_total: int = 0
    offload_restored_total: int = 0
    # Tokens preempted requests got back on resume: copied from the tier (swap), and
    # computed again (recompute); hits still in the pool count in neither.
    swapped_in_tokens_total: int = 0
    recomputed_tokens_total: int = 0
    # Speculative decoding (all 0 when off): draft tokens verified, of those kept, and the
    # request-steps that verified drafts (tokens per verification = 1 + kept / steps).
    spec_drafted_total: int = 0
    spec_accepted_total: int = 0
    spec_verifications_total: int = 0
    # LoRA adapters (--lora-dir): resident now (least recently used first), how many of
    # them live requests hold, and loads from disk and evictions since start.
    lora_resident: tuple[str, ...] = ()
    lora_held: int = 0
    lora_loads_total: int = 0
    lora_evictions_total: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Kept / verified draft tokens since start (0 before any)."""
        return (
            self.spec_accepted_total / self.spec_drafted_total if self.spec_drafted_total else 0.0
        )

    @property
    def prefix_hit_ratio(self) -> float:
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )

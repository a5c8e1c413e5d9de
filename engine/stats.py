"""Engine statistics snapshot, shared by the services' Stats RPC and metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """Counts at one instant. `used_blocks` includes held (exported) and importing blocks;
    free cached blocks count as free. A leak check asserts `used_blocks == 0` when idle."""

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

    @property
    def prefix_hit_ratio(self) -> float:
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )

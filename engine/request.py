"""One generation request as the engine tracks it.

Lifecycle: WAITING (queued; also where a preempted request goes back, keeping its output
tokens) -> RUNNING (holds blocks; prefill chunks, then one token per step) -> FINISHED_*.
Imported requests start in IMPORTING (blocks reserved, KV being read from a prefill
engine) and join RUNNING on commit. A request finished with `hold_kv` keeps its blocks,
pinned for export, until the engine is told to release them.

`num_computed_tokens` counts tokens whose KV is in the cache; `all_token_ids` is prompt
plus output. When computed reaches the total, the last logits are sampled.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    IMPORTING = "importing"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass
class Request:
    """Mutable per-request state owned by the engine (never shared across threads)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    hash_seed: int
    hold_kv: bool = False
    # Phase timestamps (time.monotonic()) for queue vs compute telemetry: `arrival_time`
    # is when the request joined this engine's queue (an import: when it was committed),
    # then its first admission to a batch and its first token sampled by this engine.
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    prefix_counted: bool = False
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status.finished

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    arrival_time: float = 0.0  # monotonic; see Request
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

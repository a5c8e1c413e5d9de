"""One generation request as the engine tracks it.

Lifecycle (every transition is the scheduler's):
  WAITING (queued; also where a preempted request goes back, keeping its output tokens)
  -> RUNNING (holds blocks; prefill chunks, then one token per step) -> FINISHED_*.
  Prefill side of a hand-off: a request added with `hold_kv` that ends (other than by an
  abort) goes RUNNING -> HELD_FOR_EXPORT: its output is over, its blocks stay pinned for
  a peer to read, and it becomes FINISHED_* when they are released.
  Decode side: an imported request starts in WAITING_FOR_REMOTE_KV (blocks reserved, the
  prompt's KV landing from a peer) and goes to WAITING on commit, or to FINISHED_* when
  the reservation is cancelled or its first token already ended it.

Why a request's output ended is its `finish_reason` (set once, when the output ends; a
held request has one while its blocks are still pinned).

A request's `priority` class orders admission and preemption (see `engine/priority.py`);
its optional `deadline` (time.monotonic() seconds) is checked only where the engine would
otherwise recompute it after a preemption: past it, the request ends with DEADLINE.

`num_computed_tokens` counts tokens whose KV is in the cache; `all_token_ids` is prompt
plus output. When computed reaches the total, the last logits are sampled.

Forks (`SamplingParams.n` > 1): the request the caller added is fork 0 and keeps its id;
forks 1..n-1 are requests of their own (`request_id` "<id>/<index>") with the caller's
id as `group_id` and their `index`. Their outputs carry the group id and the index, so a
caller reads one stream per group; an abort of the group id ends every fork.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.cache_share import NO_OWNER, CacheOwner
from engine.errors import DeadlineExceededError
from engine.finish_reason import FinishReason
from engine.grammar import Grammar
from engine.logprobs import TokenLogprobs
from engine.lora import LoraAdapter
from engine.priority import Priority
from engine.sampler import new_generator, position_seed
from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its lifecycle (see the module docstring)."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    HELD_FOR_EXPORT = "held_for_export"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_DEADLINE = "finished_deadline"

    @staticmethod
    def finished_with(reason: FinishReason) -> RequestStatus:
        return _FINISHED[reason]


_FINISHED = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.DEADLINE: RequestStatus.FINISHED_DEADLINE,
}


@dataclass
class Request:
    """Mutable per-request state owned by the engine (never shared across threads)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    hash_seed: int
    # Whose share of the prefix cache its blocks count in (engine/cache_share.py).
    cache_owner: CacheOwner = NO_OWNER
    hold_kv: bool = False
    priority: Priority = Priority.STANDARD
    deadline: float | None = None  # time.monotonic() seconds; None: no deadline
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
    swapped_blocks: int = 0  # leading block hashes the offload tier keeps while preempted
    prefix_counted: bool = False
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    # Forks: the caller's id (empty: this request's own) and this fork's index.
    group_id: str = ""
    index: int = 0
    # Prefill side of a hand-off with n > 1: forks 1..n-1's first tokens, sampled from
    # the prompt's last logits with their own generators (the decode side forks).
    fork_token_ids: list[int] = field(default_factory=list)
    fork_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # prompt_logprobs asked: positions 1.. as prefill chunks compute them.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    grammar: Grammar | None = None  # structured output: the state after the output so far
    forked: bool = False  # n > 1: its forks exist (or, on a prefill engine, were sampled)
    # Speculative decoding: this step's draft tokens, after the output (`speculation.py`);
    # set before the step is scheduled, cleared once verified (or the request preempted).
    draft_token_ids: list[int] = field(default_factory=list)
    spec_drafted: int = 0  # draft tokens this request verified, and kept, on this engine
    spec_accepted: int = 0
    # Its LoRA adapter (None: the base model), held in the engine's `LoraSet` from when
    # the request is added until the scheduler retires it; folded into `hash_seed`.
    lora: LoraAdapter | None = field(default=None, repr=False, compare=False)

    @property
    def group(self) -> str:
        """The id the caller knows this request by (a fork's parent's)."""
        return self.group_id or self.request_id

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
        """The output is over (the request may still hold blocks for export)."""
        return self.finish_reason is not None

    def past_deadline(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def draw_generator(self) -> torch.Generator | None:
        """The generator for the next sampled token: a seeded request's is re-keyed on
        (seed, output position) first (`position_seed`), so its draws do not depend on
        which engine made the earlier ones; an unseeded one's just runs on."""
        if self.generator is not None and self.sampling.seed is not None:
            position = len(self.output_token_ids)
            self.generator.manual_seed(position_seed(self.sampling.seed, position))
        return self.generator

    def draw_generator_at(self, position: int) -> torch.Generator | None:
        """A generator for the draw at output `position` (speculative decoding samples
        several positions in one step): a seeded request's is a new one keyed as
        `draw_generator` keys it; an unseeded one's shared generator just runs on."""
        if self.generator is None or self.sampling.seed is None:
            return self.generator
        return new_generator(position_seed(self.sampling.seed, position))

    def token_at(self, index: int) -> int:
        """The token at sequence position `index`: prompt, output, then this step's drafts."""
        n = len(self.prompt_token_ids)
        if index < n:
            return self.prompt_token_ids[index]
        m = len(self.output_token_ids)
        return (
            self.output_token_ids[index - n]
            if index - n < m
            else self.draft_token_ids[index - n - m]
        )


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    arrival_time: float = 0.0  # monotonic; see Request
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    index: int = 0  # the fork (n > 1); request_id is then the group's id
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token, when asked
    # prompt_logprobs asked: positions 1..end, on the output with the first token.
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    # Prefill side, n > 1: forks 1..n-1's first tokens (and logprobs, when asked).
    fork_token_ids: tuple[int, ...] = ()
    fork_logprobs: tuple[TokenLogprobs, ...] = ()
    spec_drafted: int = 0  # speculative decoding: draft tokens verified so far, and kept
    spec_accepted: int = 0

    def raise_for_deadline(self) -> None:
        """DeadlineExceededError if the engine ended the request on its deadline (a worker
        answers the call with DEADLINE_EXCEEDED rather than a finished output)."""
        if self.finish_reason is FinishReason.DEADLINE:
            raise DeadlineExceededError(
                f"request {self.request_id} passed its deadline while preempted for KV cache "
                "space and was ended rather than recomputed; the worker is overloaded: retry "
                "later, with a longer deadline or a higher priority"
            )

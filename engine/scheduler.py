"""Continuous batching with chunked prefill, prefix-cache admission and preemption.

Lifecycle of one step: `schedule()` first gives every RUNNING request its next tokens (one
for a decode, up to the remaining token budget for a prefill chunk), growing its block
table as needed; decodes are served before any prefill chunk takes the rest, and prefill
chunks go fewest-remaining-tokens first (see `_schedule_running` for the guards), so a
long prompt starves neither the running streams nor the short prompts behind it. If the
pool runs dry it preempts the lowest-priority running request (the most recently
admitted) by recompute: its blocks are freed and it goes back to the head of the queue,
keeping its output tokens. Then, if nothing was preempted, it admits WAITING requests in
arrival order while the budget, `max_num_seqs` and free blocks allow, reusing cached
prefix blocks. After the model runs, the engine calls `advance` for each scheduled
request (which publishes newly full blocks to the prefix cache) and `finish` when a
request stops. Nothing here runs the model or samples.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_pool import BlockPool
from engine.prefix_hash import prefix_block_hashes
from engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be > 0")


@dataclass
class ScheduledBatch:
    """One step's work: decodes (one new token each) first, then prefill chunks."""

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def items(self) -> list[tuple[Request, int]]:
        return [(r, 1) for r in self.decodes] + self.prefills

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)


class Scheduler:
    """Decides which requests run each step; owns the waiting queue and the running list."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    # -- queue -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        """Place every RUNNING request's next tokens; returns the budget left for admission.

        Decodes come first whatever their place in the list: running streams never stall
        behind a prompt (their inter-token latency would include all of it). Prefill
        chunks follow, the fewest remaining tokens first: a chat prompt admitted next to
        a 4k-token one finishes in a step or two instead of waiting for all of it, which
        costs the long prompt little (its TTFT is long anyway). While requests wait, the
        running prefills take at most half the budget between them, so a new prompt is
        admitted within a step or two however many long prompts are in flight. Neither
        starves the other: admission gets only what running requests leave, and the
        prompts ahead of a long one in the order only ever finish.
        """
        decodes: list[Request] = []
        prefills: list[Request] = []
        for req in self.running:
            (decodes if _remaining(req) == 1 else prefills).append(req)
        for req in decodes:
            if req.status is not RequestStatus.RUNNING:
                continue  # already preempted to make room for an earlier request
            if budget - batch.num_tokens <= 0 or not self._place(batch, req, 1):
                return budget - batch.num_tokens
        admissible = self.waiting and len(self.running) < self.config.max_num_seqs
        # Running prefills together leave half the budget to admission while requests
        # wait: two long prompts in flight would otherwise hold every step between them.
        ceiling = budget - (budget // 2 if admissible else 0)
        for req in sorted(prefills, key=_remaining):
            if req.status is not RequestStatus.RUNNING:
                continue
            n = min(_remaining(req), ceiling - batch.num_tokens)
            if n > 0 and not self._place(batch, req, n):
                break
        return budget - batch.num_tokens

    def _place(self, batch: ScheduledBatch, req: Request, n: int) -> bool:
        """Grow `req` by `n` tokens and schedule it, preempting from the back when short.

        Preemption takes the most recently admitted request, which may already be in this
        batch (prefills are placed out of list order): it is taken out again. False when
        `req` itself had to go.
        """
        while not self._grow(req, req.num_computed_tokens + n):
            victim = self.running.pop()
            batch.decodes = [r for r in batch.decodes if r is not victim]
            batch.prefills = [(r, k) for r, k in batch.prefills if r is not victim]
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is req:
                return False
        self._add_to_batch(batch, req, n)
        return True

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            # A fresh or preempted request claims cached prefix blocks; an imported one
            # already holds its prompt's blocks and must keep them if it has to wait.
            claimed = not req.block_ids
            hits = self._claim_prefix(req) if claimed else []
            n = min(_remaining(req), budget)
            if not self._grow(req, req.num_computed_tokens + n):
                if claimed:
                    self._unclaim_prefix(req, hits)
                return
            self.waiting.popleft()
            self.count_prefix(req)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_to_batch(batch, req, n)
            budget -= n

    @staticmethod
    def _add_to_batch(batch: ScheduledBatch, req: Request, n: int) -> None:
        if n == 1:
            batch.decodes.append(req)
        else:
            batch.prefills.append((req, n))

    # -- blocks ------------------------------------------------------------------
    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Make the block table cover `num_tokens`; False (allocating nothing) if short."""
        need = -(-num_tokens // self.config.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        req.block_ids.extend(self.pool.allocate(need))
        return True

    def _claim_prefix(self, req: Request) -> list[int]:
        """Reuse cached blocks for the longest cached prefix (always computing >= 1 token)."""
        self.extend_hashes(req, req.num_tokens)
        max_hit = (req.num_tokens - 1) // self.config.block_size
        hits = self.pool.longest_cached_prefix(req.block_hashes[:max_hit])
        self.pool.touch(hits)
        req.block_ids = list(hits)
        req.num_computed_tokens = len(hits) * self.config.block_size
        if req.num_preemptions == 0:
            # Counted once per request: a recompute after preemption is not a user hit.
            req.num_cached_tokens = req.num_computed_tokens
        return hits

    def count_prefix(self, req: Request) -> None:
        """Add a request's prompt and cache-hit tokens to the prefix stats, once."""
        if not req.prefix_counted:
            req.prefix_counted = True
            self.prefix_query_tokens += req.num_prompt_tokens
            self.prefix_hit_tokens += req.num_cached_tokens

    def _unclaim_prefix(self, req: Request, hits: list[int]) -> None:
        self.pool.free(reversed(hits))
        req.block_ids = []
        req.num_computed_tokens = 0

    def extend_hashes(self, req: Request, num_tokens: int) -> None:
        """Hash the full blocks among the first `num_tokens` tokens not hashed yet."""
        bs = self.config.block_size
        done = len(req.block_hashes)
        if (num_tokens // bs) <= done:
            return
        prev = req.block_hashes[-1] if done else None
        req.block_hashes.extend(
            prefix_block_hashes(
                req.all_token_ids[: num_tokens - num_tokens % bs],
                bs,
                req.hash_seed,
                start=done,
                prev_hash=prev,
            )
        )

    def publish_full_blocks(self, req: Request) -> None:
        """Put the request's computed full blocks into the prefix cache."""
        self.extend_hashes(req, req.num_computed_tokens)
        n_full = req.num_computed_tokens // self.config.block_size
        for j in range(n_full):
            if self.pool.block_hash(req.block_ids[j]) is None:
                self.pool.cache_full_block(req.block_ids[j], req.block_hashes[j])

    def advance(self, req: Request, num_new: int) -> None:
        """Record that the model computed `num_new` more tokens of `req`."""
        req.num_computed_tokens += num_new
        self.publish_full_blocks(req)

    def _preempt(self, req: Request) -> None:
        self.pool.free(reversed(req.block_ids))
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    # -- endings -----------------------------------------------------------------
    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take `req` out of the queues; free its blocks unless it holds them for export."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if not (req.hold_kv and status is not RequestStatus.FINISHED_ABORTED):
            self.release_blocks(req)

    def release_blocks(self, req: Request) -> None:
        self.pool.free(reversed(req.block_ids))
        req.block_ids = []


def _remaining(req: Request) -> int:
    """Tokens `req` still has to compute before its next sample (1 for a decode)."""
    return req.num_tokens - req.num_computed_tokens

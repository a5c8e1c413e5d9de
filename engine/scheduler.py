"""Continuous batching with chunked prefill, prefix-cache admission and preemption, and
the states of a KV hand-off: the scheduler owns every live request and every transition.

Lifecycle of one step: `schedule()` first gives every RUNNING request its next tokens (one
for a decode, up to the budget for a prefill chunk; the order is `_schedule_running`'s),
growing its block table as needed. If the pool runs dry it preempts by recompute: the
victim is the lowest priority class's most recently admitted request, never one of a
higher class than the request that needs room (that one preempts itself instead). The
victim's blocks are freed and it goes back to the head of its class in the queue,
keeping its output tokens; or, already past its deadline, it ends with DEADLINE
(`ScheduledBatch.expired`). Its full blocks stay cached, kept by an offload tier once the
pool gives them up (swap), and on resume come back as a prefix hit, copied where
`restore_pays` (restore_gate.py). Then, unless a preemption found the pool dry, it admits
WAITING requests, highest class first and in arrival order within a class
(`waiting_queue.py`), while the budget, `max_num_seqs` and free blocks allow, reusing
cached prefix blocks. Where tenants share the pool, admissions and prompt chunks are
held to the tenant's share (`cache_guard.py`), which holds back only that tenant. After
the model runs, the engine calls `advance` for each scheduled request (publishing newly
full blocks to the prefix cache) and `finish` when one stops. It never runs the model.

Hand-off states (see `engine/request.py`), outside the step's queues and never scheduled:
  prefill: `finish` of a hold_kv request (a stop or length) -> HELD_FOR_EXPORT in `held`,
  blocks pinned -> `release_held` frees them (full blocks stay in the prefix cache);
  decode: `reserve_import` -> WAITING_FOR_REMOTE_KV in `importing`, blocks reserved ->
  `commit_import` (the bytes landed: publish the blocks, queue as WAITING) or
  `cancel_import` (free them). `abort` of a landing import only marks it: its blocks
  are freed at its commit or cancel, never under a transfer that may still write them.
`requests` maps the id of every request in any of these states to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.block_pool import BlockPool
from engine.cache_guard import CacheGuard
from engine.errors import OutOfBlocksError, UnknownRequestError
from engine.finish_reason import FinishReason
from engine.kv_offload import OffloadTier
from engine.prefix_hash import prefix_block_hashes
from engine.priority import Priority
from engine.request import Request, RequestStatus
from engine.scheduled_batch import ScheduledBatch
from engine.waiting_queue import WaitingQueue


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be > 0")


class Scheduler:
    """Decides which requests run each step; owns every live request and its state.

    Not thread-safe: the engine calls it under its step lock.
    """

    def __init__(self, config: SchedulerConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.held: dict[str, Request] = {}  # HELD_FOR_EXPORT
        self.importing: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV
        self.guard = CacheGuard(pool, config.block_size, self.running, self.held, self.importing)
        # Imports aborted while their bytes may still be landing (see the module doc).
        self._abort_on_landing: set[str] = set()
        self.num_preemptions = 0
        self.preemptions_by_class = [0] * len(Priority)
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        #: The prefix cache's second tier (None: evicted blocks are gone).
        self.tier: OffloadTier | None = None
        #: Asked before each block restored from the tier (False: compute it again).
        self.restore_pays: Callable[[], bool] = lambda: True
        self.offload_hit_tokens = 0
        # Tokens preempted requests got back on resume: restored from the tier (swap),
        # and computed again (recompute; hits still in the pool are in neither).
        self.swapped_in_tokens = 0
        self.recomputed_tokens = 0
        #: Called once for each request that leaves (the engine lets go of its adapter).
        self.on_retire: Callable[[Request], None] | None = None

    # -- queue -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self.requests[req.request_id] = req

    def has_work(self) -> bool:  # (hand-off states are never scheduled)
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        if not batch.dry:
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
        prompts ahead of a long one in the order only ever finish. Across classes, each
        of the two passes serves higher classes first.
        """
        decodes: list[Request] = []
        prefills: list[Request] = []
        # Higher classes first (a stable sort: admission order within a class), so they
        # get the budget first when it is short.
        for req in sorted(self.running, key=_by_class):
            (decodes if _remaining(req) == 1 else prefills).append(req)
        # Once a request of class c had to preempt itself, the pool is dry for class c:
        # only requests of a higher class (which may preempt lower ones) go on.
        floor = -1
        for i, req in enumerate(decodes):
            if req.status is not RequestStatus.RUNNING or req.priority <= floor:
                req.draft_token_ids = []
                continue  # preempted for a request placed before it, or its class is dry
            if budget - batch.num_tokens <= 0:
                for unplaced in decodes[i:]:  # drafts only ride with a placed decode
                    unplaced.draft_token_ids = []
                return budget - batch.num_tokens
            if not self._place(batch, req, 1 + self._fit_drafts(req, budget - batch.num_tokens)):
                floor = req.priority
        admissible = self.waiting and len(self.running) < self.config.max_num_seqs
        # Running prefills together leave half the budget to admission while requests
        # wait: two long prompts in flight would otherwise hold every step between them.
        ceiling = budget - (budget // 2 if admissible else 0)
        for req in sorted(prefills, key=lambda r: (_by_class(r), _remaining(r))):
            if req.status is not RequestStatus.RUNNING or req.priority <= floor:
                continue
            n = min(_remaining(req), ceiling - batch.num_tokens)
            if n > 0 and not self._place(batch, req, n):
                floor = req.priority
        return budget - batch.num_tokens

    def _fit_drafts(self, req: Request, budget: int) -> int:
        """How many of a decode's draft tokens go into this step: what the token budget
        and the free blocks allow without preempting anyone (drafts are a bet, never
        worth a preemption). The rest are dropped."""
        drafts = req.draft_token_ids[: max(0, budget - 1)]
        bs = self.config.block_size
        # Leave a block per running request: the next decodes of this step come first.
        spare = self.pool.num_free - len(self.running)
        while drafts:
            target = req.num_computed_tokens + 1 + len(drafts)
            need = -(-target // bs) - len(req.block_ids)
            if need <= max(0, spare) and self._grow(req, target, self.guard.draft_room()):
                break
            drafts = drafts[:-1]
        req.draft_token_ids = drafts
        return len(drafts)

    def trim_drafts(self, req: Request) -> None:
        """After a verification: free the blocks that only rejected drafts' KV reached
        (past what the request's tokens need). Slots of rejected drafts in a block that
        stays are past `num_computed_tokens`: overwritten before that block is full, so
        never published to the prefix cache."""
        keep = -(-req.num_tokens // self.config.block_size)
        if len(req.block_ids) > keep:
            extra = req.block_ids[keep:]
            req.block_ids = req.block_ids[:keep]
            self.pool.free(reversed(extra))

    def _place(self, batch: ScheduledBatch, req: Request, n: int) -> bool:
        """Grow `req` by `n` tokens and schedule it, preempting (`_victim`) when short.

        The victim may already be in this batch (requests are placed out of admission
        order): it is taken out again. False when `req` itself had to go for want of
        blocks (its class is dry this step); True when placed, or when its tenant's share
        alone held it back (cache_guard.py: others of its class may go on).
        """
        target = req.num_computed_tokens + n
        guarded = self.guard.guards_growth(req, target)  # decided once (cache_guard.py)
        while not self._grow(req, target, self.guard.growth_room(req) if guarded else None):
            victim = self.running.pop(self._victim(req, guarded))
            batch.drop(victim)
            self._preempt(victim, batch)
            if guarded:
                batch.held_back.add(req.cache_owner.tenant)
            else:
                batch.dry = True
            if victim is req:
                return guarded  # held back by its tenant's share: the class is not dry
        batch.add(req, n)
        return True

    def _victim(self, req: Request, guarded: bool) -> int:
        """Where in `running` the request to preempt for `req`'s growth is: the lowest
        class's newest (of `req`'s tenant in a `guarded` placement). `req` runs too, so
        the victim is never of a higher class, nor an older request of its class: when
        nothing newer or lower is left, it is `req` (it waits rather than take from above)."""
        newest_first = reversed(self.guard.gives_way(req, guarded))
        return min(newest_first, key=lambda i: self.running[i].priority)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        held_back = batch.held_back  # tenants the cache guard alone kept waiting this step
        for req in list(self.waiting):  # (a copy: admitted requests leave the queue)
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if req.cache_owner.tenant in held_back:
                continue  # its tenant's order holds: nothing of it passes its first
            if req.num_preemptions and req.past_deadline(time.monotonic()):
                self.waiting.remove(req)  # it would be recomputed for nobody: end it
                self._expire(req, batch)
                continue
            # A fresh or preempted request claims cached prefix blocks; an imported one
            # holds its prompt's blocks already, and keeps them if it has to wait.
            claimed = not req.block_ids
            hits = self._claim_prefix(req) if claimed else []
            n = min(_remaining(req), budget)
            target = req.num_computed_tokens + n
            room = self.guard.admission_room(req, target)
            if not self._grow(req, target, room):
                if claimed:
                    self._unclaim_prefix(req, hits)
                if not self.guard.held_back(req, target, room):
                    return  # the pool is short for everyone: the order waits
                held_back.add(req.cache_owner.tenant)  # other tenants' requests may go
                continue
            self.waiting.remove(req)
            if req.num_preemptions and claimed:  # resumed: the tier may let go of its KV
                self._keep_swapped(req, 0)
                self.recomputed_tokens += _remaining(req)
            self._count_prefix(req)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.add(req, n)
            budget -= n

    # -- blocks ------------------------------------------------------------------
    def _grow(self, req: Request, num_tokens: int, room: int | None = None) -> bool:
        """Cover `num_tokens`; False (allocating nothing) if short (`BlockPool.grow`;
        `room`: the tenant guard's headroom, engine/cache_guard.py)."""
        bs = self.config.block_size
        return self.pool.grow(req.block_ids, num_tokens, bs, req.cache_owner, headroom=room)

    def _claim_prefix(self, req: Request) -> list[int]:
        """Reuse cached blocks for the longest cached prefix (always computing >= 1 token)."""
        self._extend_hashes(req, req.num_tokens)
        max_hit = (req.num_tokens - 1) // self.config.block_size
        if req.sampling.prompt_logprobs is not None:
            # Cached blocks hold no logits: compute every prompt position whose
            # log-probability is still owed (all of them, unless a preemption came after).
            max_hit = min(max_hit, len(req.prompt_logprobs) // self.config.block_size)
        hits = self.pool.longest_cached_prefix(req.block_hashes[:max_hit])
        self.pool.touch(hits)
        hits += self._restore_prefix(req, len(hits), max_hit)
        req.block_ids = list(hits)
        req.num_computed_tokens = len(hits) * self.config.block_size
        if req.num_preemptions == 0:
            # Counted once per request: a recompute after preemption is not a user hit.
            req.num_cached_tokens = req.num_computed_tokens
        return hits

    def _restore_prefix(self, req: Request, first: int, last: int) -> list[int]:
        """Continue a prefix hit past the pool's blocks [first, last) from the offload tier
        (`OffloadTier.restore_prefix`), held to the tenant's share where its admission is.

        Leaves free blocks for one chunk of the rest of the prompt: a request that then
        could not start would give its restored blocks back and restore them again on
        every step it waits."""
        tier, bs = self.tier, self.config.block_size
        if tier is None or not self.restore_pays():
            return []
        rest = req.num_tokens - last * bs
        reserve = -(-min(max(rest, 1), self.config.max_num_batched_tokens) // bs)
        hashes, guarded = req.block_hashes[first:last], self.guard.guards_admission(req)
        out, copied = tier.restore_prefix(
            self.pool, hashes, req.cache_owner, reserve=reserve, guarded=guarded
        )
        if req.num_preemptions == 0:
            self.offload_hit_tokens += copied * bs
        else:
            self.swapped_in_tokens += copied * bs
        return out

    def _count_prefix(self, req: Request) -> None:
        """Add a request's prompt and cache-hit tokens to the prefix stats, once."""
        if not req.prefix_counted:
            req.prefix_counted = True
            self.prefix_query_tokens += req.num_prompt_tokens
            self.prefix_hit_tokens += req.num_cached_tokens

    def _unclaim_prefix(self, req: Request, hits: list[int]) -> None:
        self.pool.free(reversed(hits))
        req.block_ids = []
        req.num_computed_tokens = 0

    def _extend_hashes(self, req: Request, num_tokens: int) -> None:
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

    def _publish_full_blocks(self, req: Request) -> None:
        """Put the request's computed full blocks into the prefix cache."""
        self._extend_hashes(req, req.num_computed_tokens)
        n_full = req.num_computed_tokens // self.config.block_size
        for j in range(n_full):
            if self.pool.block_hash(req.block_ids[j]) is None:
                self.pool.cache_full_block(req.block_ids[j], req.block_hashes[j], req.cache_owner)

    def advance(self, req: Request, num_new: int) -> None:
        """Record that the model computed `num_new` more tokens of `req`."""
        req.num_computed_tokens += num_new
        self._publish_full_blocks(req)

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        """Free a (no longer running) request's blocks; requeue it at the head of its class
        for recompute, or end it with DEADLINE if that has passed."""
        self.pool.free(reversed(req.block_ids))
        self._keep_swapped(req, req.num_computed_tokens // self.config.block_size)
        req.block_ids = []
        req.draft_token_ids = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_class[req.priority] += 1
        batch.preempted.append(req)
        if req.past_deadline(time.monotonic()):
            self._expire(req, batch)
            return
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _keep_swapped(self, req: Request, n_full: int) -> None:
        """The tier keeps `req`'s first `n_full` block hashes (0: lets go of older ones)."""
        if self.tier is not None:
            self.tier.unkeep(req.block_hashes[: req.swapped_blocks])
            self.tier.keep(req.block_hashes[:n_full])
        req.swapped_blocks = n_full

    def _expire(self, req: Request, batch: ScheduledBatch) -> None:
        """End a preempted request with DEADLINE (never held for export: nobody waits for
        its KV); the engine reports it from `batch.expired`."""
        self._retire(req, FinishReason.DEADLINE)
        batch.expired.append(req)

    # -- endings -----------------------------------------------------------------
    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a WAITING or RUNNING request's output with `reason` (a no-op once ended).

        Its blocks are freed, except a hold_kv request's that completed (a stop or the
        length limit): it goes to HELD_FOR_EXPORT with its blocks pinned until
        `release_held`.
        """
        if req.finished:
            return
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.hold_kv and reason.completed:
            req.status = RequestStatus.HELD_FOR_EXPORT
            self.held[req.request_id] = req
            return
        self._retire(req, reason)

    def abort(self, request_id: str) -> Request | None:
        """Cancel a request in any state; returns it when its output was still open.

        WAITING or RUNNING: finished as aborted, blocks freed, returned (its stream gets a
        last output). HELD_FOR_EXPORT: its blocks are released. WAITING_FOR_REMOTE_KV:
        marked, freed when the import commits or cancels. Unknown ids are ignored.
        """
        if self.release_held(request_id):
            return None
        if request_id in self.importing:
            self._abort_on_landing.add(request_id)
            return None
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.finish(req, FinishReason.ABORT)
        return req

    def _retire(self, req: Request, reason: FinishReason) -> None:
        """The request leaves the scheduler: blocks freed, FINISHED_*, forgotten."""
        self.pool.free(reversed(req.block_ids))
        self._keep_swapped(req, 0)
        req.block_ids = []
        req.finish_reason = reason
        req.status = RequestStatus.finished_with(reason)
        if self.requests.get(req.request_id) is req:
            del self.requests[req.request_id]
        if self.on_retire is not None:
            self.on_retire(req)

    # -- hand-off ----------------------------------------------------------------
    def release_held(self, request_id: str) -> bool:
        """HELD_FOR_EXPORT -> FINISHED_*: unpin the blocks; False if it is not held."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self._retire(req, req.finish_reason or FinishReason.STOP)
        return True

    def reserve_import(self, req: Request) -> int:
        """A new request whose prompt's KV comes from a peer -> WAITING_FOR_REMOTE_KV.

        `req` already holds its output so far: the first token the peer sampled, or a
        migrated stream's tokens (whose KV the first step after the commit computes, as
        a prefill chunk). Gives it blocks for the whole prompt, reusing the longest
        cached prefix, and returns how many leading blocks were cached (they need no
        transfer). Raises OutOfBlocksError, taking nothing, when the pool is short.
        """
        self._extend_hashes(req, req.num_prompt_tokens)
        hits = self.pool.longest_cached_prefix(req.block_hashes)
        self.pool.touch(hits)  # off the free list first: a hit cannot also be allocated
        req.block_ids = list(hits)
        room = self.guard.admission_room(req, req.num_prompt_tokens)  # its outputs' rest too
        if not self._grow(req, req.num_prompt_tokens, room):
            self._unclaim_prefix(req, hits)
            raise OutOfBlocksError(f"import of {req.request_id}: too few KV blocks")
        req.num_cached_tokens = len(hits) * self.config.block_size
        self._count_prefix(req)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.importing[req.request_id] = req
        self.requests[req.request_id] = req
        return len(hits)

    def commit_import(self, request_id: str) -> Request | None:
        """The reserved blocks hold the prompt's KV: WAITING_FOR_REMOTE_KV -> WAITING.

        Publishes the full blocks to the prefix cache and queues the request to decode its
        second token (a migrated stream: to compute its output's KV, then go on). Returns
        None, freeing the blocks, for an import aborted while landing; UnknownRequestError
        if `request_id` is not importing.
        """
        req = self.importing.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(request_id)
        if request_id in self._abort_on_landing:
            self._abort_on_landing.discard(request_id)
            self._retire(req, FinishReason.ABORT)
            return None
        req.num_computed_tokens = req.num_prompt_tokens
        self._publish_full_blocks(req)
        req.arrival_time = time.monotonic()  # decode's queue starts now, not at reserve
        self.add(req)
        return req

    def cancel_import(self, request_id: str) -> bool:
        """WAITING_FOR_REMOTE_KV -> FINISHED_ABORTED, blocks freed; False if none.

        The caller guarantees no transfer still writes into the blocks.
        """
        self._abort_on_landing.discard(request_id)
        req = self.importing.pop(request_id, None)
        if req is None:
            return False
        self._retire(req, FinishReason.ABORT)
        return True

    def handoff_blocks(self) -> tuple[int, int]:
        """(blocks held for export, blocks reserved for imports)."""
        held, importing = self.held.values(), self.importing.values()
        return sum(len(r.block_ids) for r in held), sum(len(r.block_ids) for r in importing)


def _by_class(req: Request) -> int:  # a sort key: higher classes first
    return -req.priority


def _remaining(req: Request) -> int:
    """Tokens `req` still has to compute before its next sample (1 for a decode)."""
    return req.num_tokens - req.num_computed_tokens

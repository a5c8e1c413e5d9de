"""Forks of a request (`SamplingParams.n` > 1) that share its prompt's KV blocks.

Lifecycle: the engine forks a request once, when its prompt's KV is complete: on a mixed
or decode engine right after the step that computed the prompt's last token (the forks
then sample their first tokens from the same logits row, each with its own generator),
on a decode engine when an import commits (the forks' first tokens were sampled on the
prefill worker). `Forker.spawn` makes fork i a request of its own ("<id>/<i>", group id
and index set, `sampling.fork(i)`), holding a reference on each of the prompt's full
blocks (nothing is recomputed or copied for them) and a private copy of the partial last
block, which each fork writes its own tokens into; it then waits to be admitted, holding
them. When the pool has no block for that copy, the fork waits without blocks and
recomputes its prompt through the prefix cache (the full blocks are cached): slower,
never wrong.

On a prefill engine (`hold_kv`) forks are only sampled, never kept: their first tokens go
to the parent's `fork_token_ids` and on to the decode worker in the KV handle.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.block_pool import BlockPool
from engine.grammar import Grammar
from engine.kv_cache import KvCache
from engine.lora import LoraAdapter
from engine.request import Request
from engine.sampler import new_generator
from engine.sampling_params import GuidedSpec
from engine.scheduler import Scheduler


def fork_id(group: str, index: int) -> str:
    return f"{group}/{index}"


class Forker:
    def __init__(
        self,
        scheduler: Scheduler,
        pool: BlockPool,
        kv_cache: KvCache,
        grammar: Callable[[GuidedSpec], Grammar],
        retain: Callable[[LoraAdapter], None],
    ) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.grammar = grammar
        self.retain = retain  # a spawned fork holds its parent's adapter too

    def sampled_only(self, parent: Request, index: int) -> Request:
        """Fork `index` as a row to sample its first token from, nothing more (prefill)."""
        sampling = parent.sampling.fork(index)
        child = Request(
            request_id=fork_id(parent.group, index), prompt_token_ids=parent.prompt_token_ids,
            sampling=sampling, hash_seed=parent.hash_seed, cache_owner=parent.cache_owner,
            priority=parent.priority, deadline=parent.deadline, group_id=parent.group, index=index,
            generator=None if sampling.greedy else new_generator(sampling.seed),
            lora=parent.lora,
        )  # fmt: skip
        if sampling.guided is not None:
            child.grammar = self.grammar(sampling.guided)
        return child

    def spawn(self, parent: Request, index: int, output: list[int]) -> Request:
        """Fork `index` of `parent` (whose prompt's KV is complete) as a live request with
        `output` as its tokens so far, sharing the prompt's blocks."""
        child = self.sampled_only(parent, index)
        child.output_token_ids = list(output)
        if child.grammar is not None:
            child.grammar.advance(output)
        child.arrival_time = parent.arrival_time
        child.first_scheduled_time = parent.first_scheduled_time
        child.prefix_counted = True  # the parent counted the prompt once
        # Queued holding its blocks (as an import is), it is admitted to decode next
        # step; without them it recomputes its prompt through the prefix cache.
        self._share_blocks(parent, child)
        if child.lora is not None:
            self.retain(child.lora)
        self.scheduler.add(child)
        return child

    def _share_blocks(self, parent: Request, child: Request) -> bool:
        prompt = parent.num_prompt_tokens
        full = prompt // self.block_size
        partial = prompt % self.block_size != 0
        if partial and self.pool.num_free < 1:
            return False
        shared = parent.block_ids[:full]
        self.pool.touch(shared)
        child.block_ids = list(shared)
        if partial:
            (copy,) = self.pool.allocate(1, child.cache_owner)
            self.kv_cache.copy_block(parent.block_ids[full], copy)
            child.block_ids.append(copy)
        child.block_hashes = list(parent.block_hashes[:full])
        child.num_computed_tokens = prompt
        child.num_cached_tokens = parent.num_cached_tokens
        return True

"""A draft model for speculative decoding: a smaller model of the same tokenizer, on the
same worker, proposing its greedy continuation as the draft (`--spec-draft-model`).

Lifecycle: the engine builds one `DraftModel` when the flag names a model directory; it
has its own weights, its own paged KV pool and its own model runner, and shares nothing
with the served model but the step's thread. Each step, `Speculator.propose` hands it
the requests that may draft and how many tokens each may; `propose` then
1. syncs each request's shadow (`Request` of the draft's own, keyed by the request id):
   its tokens become the request's tokens now, and its computed KV is cut back to the
   longest prefix it shares with them (drafts the served model rejected are forgotten;
   their slots are overwritten later);
2. runs one batched catch-up pass (each shadow's uncomputed tokens as one chunk) whose
   last logits give every request its first draft token (argmax);
3. runs k - 1 more batched one-token passes for the rest, each request stopping at its
   own k.
A request whose shadow cannot get blocks from the draft's pool drafts nothing this step
(drafts never preempt anything). `forget` frees a request's shadow when it ends.

Greedy drafts are deterministic proposals, which is what makes the acceptance rule
exact (`speculation.py`). Served as its own draft, a model proposes what it will verify:
acceptance 1.0 on greedy requests, up to the rounding of chunked against one-token
passes (the test of this module).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from engine.attention import select_backend
from engine.block_pool import BlockPool
from engine.config import AttentionBackendName
from engine.invariance import NOT_INVARIANT, InvariantChoice
from engine.kv_cache import KvCache
from engine.kv_layout import KvLayout, blocks_for_budget
from engine.linear_kernel import pick_linear_kernel
from engine.llama import LlamaModel
from engine.model_runner import ModelRunner
from engine.model_spec import ModelSpec
from engine.precision import WeightQuant
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduled_batch import ScheduledBatch
from engine.tokenizer import Tokenizer

_SHADOW_PARAMS = SamplingParams(max_tokens=1)  # never sampled: drafts are argmaxes


class DraftModel:
    """The draft model and its KV pool; called under the engine's step lock only."""

    def __init__(
        self,
        model_dir: Path,
        tokenizer: Tokenizer,
        *,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        kv_cache_bytes: int,
        invariance: InvariantChoice = NOT_INVARIANT,
    ) -> None:
        spec = ModelSpec.from_dir(model_dir)
        if not tokenizer.same_vocabulary(Tokenizer(model_dir)):
            raise ValueError(
                f"spec_draft_model: its vocabulary ({model_dir}) must be the served model's "
                "(every token the same id): a draft proposes tokens in the same vocabulary"
            )
        # The target's kernels: under batch invariance a draft's proposals (which seeded
        # sampling's acceptance reads) must not depend on the batch either.
        kernel = pick_linear_kernel(invariance.linear_kernel, device, dtype, WeightQuant.NONE)
        self.model = LlamaModel(spec, dtype, device, kernel)
        self.model.load_weights(model_dir, progress=False)
        layout = KvLayout.from_spec(spec, dtype, block_size, device)
        num_blocks = blocks_for_budget(layout, kv_cache_bytes)
        self.pool = BlockPool(num_blocks)
        backend = select_backend(
            AttentionBackendName.AUTO, device, dtype, invariant=invariance.invariant
        )
        self.runner = ModelRunner(self.model, KvCache(layout, num_blocks, device), backend,
                                  block_size)  # fmt: skip
        self.block_size = block_size
        self.shadows: dict[str, Request] = {}

    def propose(self, reqs: Sequence[Request], lengths: Sequence[int]) -> list[list[int]]:
        """Up to `lengths[i]` greedy draft tokens for each of `reqs`."""
        drafts: list[list[int]] = [[] for _ in reqs]
        live = [i for i, req in enumerate(reqs) if lengths[i] > 0 and self._sync(req)]
        if not live:
            return drafts
        chunks: list[tuple[Request, int | None]] = [
            (self.shadows[reqs[i].request_id], None) for i in live
        ]
        for step in range(max(lengths[i] for i in live)):
            tokens = self._pass(chunks)
            for i, token in zip(live, tokens, strict=True):
                if step < lengths[i]:
                    drafts[i].append(token)
            live = [i for i in live if len(drafts[i]) < lengths[i] and self._room(reqs[i])]
            if not live:
                break
            chunks = [(self.shadows[reqs[i].request_id], drafts[i][-1]) for i in live]
        return drafts

    def _sync(self, req: Request) -> bool:
        """Point `req`'s shadow at its tokens now, keeping the KV of the prefix they share;
        False (no draft this step) when the draft's pool has no room for them."""
        tokens = req.all_token_ids
        shadow = self.shadows.get(req.request_id)
        if shadow is None:
            shadow = Request(req.request_id, [], _SHADOW_PARAMS, 0)
            self.shadows[req.request_id] = shadow
        kept = 0
        old = shadow.all_token_ids
        limit = min(shadow.num_computed_tokens, len(tokens) - 1)  # >= 1 token to compute
        while kept < limit and old[kept] == tokens[kept]:
            kept += 1
        shadow.prompt_token_ids, shadow.output_token_ids = list(tokens), []
        shadow.num_computed_tokens = kept
        return self._grow(shadow, len(tokens))

    def _room(self, req: Request) -> bool:
        shadow = self.shadows[req.request_id]
        return self._grow(shadow, shadow.num_tokens + 1)

    def _grow(self, shadow: Request, tokens: int) -> bool:
        return self.pool.grow(shadow.block_ids, tokens, self.block_size)

    def _pass(self, chunks: list[tuple[Request, int | None]]) -> list[int]:
        """One batched forward pass: each shadow computes its uncomputed tokens (after
        appending `token`, its previous draft, when given); its argmax next tokens."""
        batch = ScheduledBatch()
        for shadow, token in chunks:
            if token is not None:
                shadow.output_token_ids.append(token)
            batch.add(shadow, shadow.num_tokens - shadow.num_computed_tokens)
        result = self.runner.execute(batch)
        for shadow, n in batch.items:
            shadow.num_computed_tokens += n
        order = {id(r): row for row, r in enumerate(result.sampling_requests)}
        picks = result.logits.argmax(dim=-1).tolist()
        return [int(picks[order[id(shadow)]]) for shadow, _ in chunks]

    def forget(self, request_id: str) -> None:
        """A request ended: free its shadow's blocks."""
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.pool.free(reversed(shadow.block_ids))

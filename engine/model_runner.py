"""Turns a scheduled batch into tensors, runs the model, and returns the rows to sample.

Lifecycle per step: `execute(batch)` lays the batch out flat (decodes first, then prefill
chunks), builds `AttentionMetadata` and the slot mapping from each request's block table,
runs one forward pass, and returns logits only for requests whose last known token was
computed this step (a mid-prompt chunk samples nothing), and for a decode verifying draft
tokens (`engine/speculation.py`) one row per position of its chunk. A request that asked for
`prompt_logprobs` also gets the log-probability of each next prompt token its chunk's
positions predict, appended to `Request.prompt_logprobs` here (positions it already has,
after a preemption, are not computed again). Rows of requests with a LoRA adapter get
their adapter's deltas in the same forward pass (`engine/lora_batch.py`). A step of
decodes only (plain or verifying drafts, up to `fused_decode.MAX_ROWS` rows) runs as the
model's fused decode instead, when it has one (`engine/fused_decode.py`): same KV
writes, same logits rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.kv_cache import KvCache
from engine.llama import LlamaModel
from engine.logprobs import token_logprobs
from engine.lora_batch import LoraBatch, LoraStacks
from engine.request import Request
from engine.scheduled_batch import ScheduledBatch

#: Prompt positions scored per LM-head call: bounds the logits tensor (rows x vocab).
SCORE_ROWS = 256


@dataclass
class StepResult:
    """Logits rows (float32, [N, vocab]) for `sampling_requests`, in the same order, then
    for each of `speculating` (requests verifying draft tokens) 1 + k rows: the positions
    of its last token and of its k drafts, in order."""

    logits: torch.Tensor
    sampling_requests: list[Request]
    speculating: list[Request] = field(default_factory=list)


class ModelRunner:
    """Owns the KV tensor's use during a step; holds no per-request state between steps."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KvCache,
        backend: AttentionBackend,
        block_size: int,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = block_size
        self.device = model.device
        self.lora_stacks = LoraStacks()
        self.fused_steps = 0  # steps the fused decode ran (the rest ran the forward)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        items = batch.items
        fused = self.model.fused
        blocks = len(self.kv_cache.blocks)
        step = fused.rows_of(items, blocks, self.block_size) if fused is not None else None
        if fused is not None and step is not None:
            self.fused_steps += 1
            logits = fused.decode(step.rows, self.kv_cache)
            return StepResult(logits, step.sampling, step.speculating)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        seqlens: list[int] = []
        last_rows: list[int] = []
        sampling: list[Request] = []
        spec_rows: list[int] = []
        speculating: list[Request] = []
        scored: list[tuple[Request, int, int]] = []  # prompt_logprobs: (request, row, n)
        for req, n in items:
            start = req.num_computed_tokens
            if req.sampling.prompt_logprobs is not None and start < req.num_prompt_tokens:
                scored.append((req, len(ids), n))
            ids.extend(req.token_at(i) for i in range(start, start + n))
            pos.extend(range(start, start + n))
            slots.extend(self._slot(req, i) for i in range(start, start + n))
            qlens.append(n)
            seqlens.append(start + n)
            if req.draft_token_ids:  # its last token and every draft: 1 + k rows
                spec_rows.extend(range(len(ids) - n, len(ids)))
                speculating.append(req)
            elif start + n == req.num_tokens:
                last_rows.append(len(ids) - 1)
                sampling.append(req)
        meta = self._metadata(items, slots, qlens, seqlens, len(batch.decodes))
        meta.plan = self.backend.plan(meta, self.block_size, self.device)
        meta.kv_write = self.kv_cache.plan_write(meta.slot_mapping)
        lora = LoraBatch.of(
            [req.lora for req, _ in items], qlens, self.lora_stacks, self.model.dtype, self.device
        )
        hidden = self.model.forward(
            torch.tensor(ids, device=self.device),
            torch.tensor(pos, device=self.device),
            self.kv_cache,
            meta,
            self.backend,
            lora,
        )
        for req, row, n in scored:
            self._score_prompt(req, hidden, row, n)
        if not last_rows and not spec_rows:
            return StepResult(torch.empty(0, 0), [])
        rows = hidden[torch.tensor(last_rows + spec_rows, device=self.device)]
        return StepResult(self.model.logits(rows), sampling, speculating)

    def _score_prompt(self, req: Request, hidden: torch.Tensor, first_row: int, n: int) -> None:
        """Append the log-probabilities of the prompt tokens this chunk's positions
        predict (position i predicts token i + 1), in pieces of `SCORE_ROWS` rows."""
        start = req.num_computed_tokens
        begin = max(start, len(req.prompt_logprobs))
        # The last prompt position predicts the output, not a prompt token.
        end = min(req.num_prompt_tokens - 1, start + n)
        top = req.sampling.prompt_logprobs or 0
        for lo in range(begin, end, SCORE_ROWS):
            hi = min(end, lo + SCORE_ROWS)
            rows = hidden[first_row + lo - start : first_row + hi - start]
            targets = req.prompt_token_ids[lo + 1 : hi + 1]
            logits = self.model.logits(rows)
            req.prompt_logprobs.extend(token_logprobs(logits, targets, [top] * len(targets)))

    def _slot(self, req: Request, index: int) -> int:
        return req.block_ids[index // self.block_size] * self.block_size + index % self.block_size

    def _metadata(
        self,
        items: list[tuple[Request, int]],
        slots: list[int],
        qlens: list[int],
        seqlens: list[int],
        num_decodes: int,
    ) -> AttentionMetadata:
        max_blocks = max(len(req.block_ids) for req, _ in items)
        table = [req.block_ids + [0] * (max_blocks - len(req.block_ids)) for req, _ in items]
        starts = [0]
        for q in qlens:
            starts.append(starts[-1] + q)
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seqlens, dtype=torch.int32, device=dev),
            block_table=torch.tensor(table, dtype=torch.int32, device=dev),
            num_decodes=num_decodes,
            max_query_len=max(qlens),
            max_seq_len=max(seqlens),
            query_lens_host=qlens,
            seq_lens_host=seqlens,
        )

"""Turns a scheduled batch into tensors, runs the model, and returns the rows to sample.

Lifecycle per step: `execute(batch)` lays the batch out flat (decodes first, then prefill
chunks), builds `AttentionMetadata` and the slot mapping from each request's block table,
runs one forward pass, and returns logits only for requests whose last known token was
computed this step (a mid-prompt chunk samples nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.llama import LlamaModel
from engine.request import Request
from engine.scheduled_batch import ScheduledBatch


@dataclass
class StepResult:
    """Logits rows (float32, [N, vocab]) for `sampling_requests`, in the same order."""

    logits: torch.Tensor
    sampling_requests: list[Request]


class ModelRunner:
    """Owns the KV tensor's use during a step; holds no per-request state between steps."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        block_size: int,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = block_size
        self.device = model.device

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        items = batch.items
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        seqlens: list[int] = []
        last_rows: list[int] = []
        sampling: list[Request] = []
        for req, n in items:
            start = req.num_computed_tokens
            ids.extend(req.token_at(i) for i in range(start, start + n))
            pos.extend(range(start, start + n))
            slots.extend(self._slot(req, i) for i in range(start, start + n))
            qlens.append(n)
            seqlens.append(start + n)
            if start + n == req.num_tokens:
                last_rows.append(len(ids) - 1)
                sampling.append(req)
        meta = self._metadata(items, slots, qlens, seqlens, len(batch.decodes))
        meta.plan = self.backend.plan(meta, self.block_size, self.device)
        hidden = self.model.forward(
            torch.tensor(ids, device=self.device),
            torch.tensor(pos, device=self.device),
            self.kv_cache,
            meta,
            self.backend,
        )
        if not last_rows:
            return StepResult(torch.empty(0, 0), [])
        rows = hidden[torch.tensor(last_rows, device=self.device)]
        return StepResult(self.model.logits(rows), sampling)

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

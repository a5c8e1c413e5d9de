"""`AttentionMetadata` for attention tests: one prefill chunk, or a batch of decodes."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata


def prefill_meta(qlen: int, seq_len: int, blocks: torch.Tensor) -> AttentionMetadata:
    """One sequence's chunk of `qlen` tokens ending at `seq_len`, over `blocks` ([n])."""
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        query_start_loc=torch.tensor([0, qlen], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_table=blocks[None].to(torch.int32),
        num_decodes=0,
        max_query_len=qlen,
        max_seq_len=seq_len,
        query_lens_host=[qlen],
        seq_lens_host=[seq_len],
    )


def decode_meta(lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    """One decode row per entry of `lens` (its context), over its row of `tables`."""
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=torch.tensor(tables, dtype=torch.int32),
        num_decodes=len(lens),
        max_query_len=1,
        max_seq_len=max(lens),
        query_lens_host=[1] * len(lens),
        seq_lens_host=lens,
    )

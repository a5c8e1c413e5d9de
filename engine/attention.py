"""Paged attention behind one interface: a torch path everywhere, vllm-flash-attn on CUDA.

Lifecycle: `select_backend(name, device)` once at engine start picks and logs a backend.
Each step the model runner builds one `AttentionMetadata` for the flat batch (decode
sequences first, then prefill chunks); every layer writes its new K/V into the paged cache
at `slot_mapping` and calls `backend.attend`. Backends never allocate cache blocks.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    """The flat batch's attention layout for one step.

    The first `num_decodes` sequences have exactly one query token; the rest are prefill
    chunks. `block_table` rows are padded with block 0 past a sequence's blocks; padding is
    masked out by `seq_lens` (tokens of context, including this step's new ones).
    """

    slot_mapping: torch.Tensor  # [T] long: flat cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32, on the model's device
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    # Host copies for the torch path's per-sequence prefill loop (no device syncs).
    query_lens_host: list[int]
    seq_lens_host: list[int]


class AttentionBackend(abc.ABC):
    """Computes attention for one layer over the paged cache.

    Preconditions: this step's K/V are already written into `k_cache`/`v_cache`
    ([num_blocks, block_size, kv_heads, head_dim]). `q` is [T, heads, head_dim].
    Returns [T, heads, head_dim]. No side effects.
    """

    name: str

    @abc.abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...


class TorchAttention(AttentionBackend):
    """Gathers each sequence's blocks and runs torch SDPA; CPU and CUDA."""

    name = "torch"

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        start = nd
        for i in range(nd, len(meta.query_lens_host)):
            qlen = meta.query_lens_host[i]
            out[start : start + qlen] = self._prefill(
                q[start : start + qlen],
                k_cache,
                v_cache,
                meta.block_table[i],
                meta.seq_lens_host[i],
            )
            start += qlen
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        nd, heads, hd = q.shape
        bs, kvh = k_cache.shape[1], k_cache.shape[2]
        nblocks = -(-max(meta.seq_lens_host[:nd]) // bs)
        table = meta.block_table[:nd, :nblocks]
        # [nd, kvh, L, hd]: only as many blocks as the longest sequence needs.
        k = k_cache[table].view(nd, nblocks * bs, kvh, hd).transpose(1, 2)
        v = v_cache[table].view(nd, nblocks * bs, kvh, hd).transpose(1, 2)
        # GQA without copying K/V: the query heads of one KV group become query rows.
        qg = q.view(nd, kvh, heads // kvh, hd)
        positions = torch.arange(nblocks * bs, device=q.device)
        mask = (positions[None, :] < meta.seq_lens[:nd, None]).view(nd, 1, 1, -1)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
        return out.reshape(nd, heads, hd)

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        table_row: torch.Tensor,
        seq_len: int,
    ) -> torch.Tensor:
        qlen, _, hd = q.shape
        bs, kvh = k_cache.shape[1], k_cache.shape[2]
        nblocks = -(-seq_len // bs)
        blocks = table_row[:nblocks]
        k = k_cache[blocks].view(nblocks * bs, kvh, hd)[:seq_len].transpose(0, 1)
        v = v_cache[blocks].view(nblocks * bs, kvh, hd)[:seq_len].transpose(0, 1)
        qh = q.transpose(0, 1)  # [heads, qlen, hd]
        if seq_len == qlen:
            out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, enable_gqa=True)
        else:
            # A later chunk: query i sits at position seq_len - qlen + i.
            qpos = torch.arange(seq_len - qlen, seq_len, device=q.device)
            kpos = torch.arange(seq_len, device=q.device)
            mask = kpos[None, :] <= qpos[:, None]
            out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=True)
        return out.transpose(0, 1)


class FlashAttention(AttentionBackend):
    """vllm-flash-attn's paged varlen kernel (CUDA only; an optional extra)."""

    name = "flash"

    def __init__(self) -> None:
        from vllm_flash_attn import flash_attn_varlen_func

        self._fn = flash_attn_varlen_func

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        out: torch.Tensor = self._fn(
            q=q,
            k=k_cache,
            v=v_cache,
            cu_seqlens_q=meta.query_start_loc,
            max_seqlen_q=meta.max_query_len,
            seqused_k=meta.seq_lens,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=q.shape[-1] ** -0.5,
            causal=True,
            block_table=meta.block_table,
        )
        return out


def flash_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import vllm_flash_attn  # noqa: F401
    except Exception:
        return False
    return True


def select_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """`auto` takes flash on CUDA with fp16/bf16 when it imports, torch otherwise."""
    if name not in ("auto", "torch", "flash"):
        raise ValueError(f"attention backend must be auto, torch or flash, got {name!r}")
    want_flash = name == "flash" or (
        name == "auto" and dtype in (torch.float16, torch.bfloat16) and flash_available(device)
    )
    if want_flash:
        if not flash_available(device):
            raise RuntimeError("attention backend 'flash' needs CUDA and vllm-flash-attn")
        backend: AttentionBackend = FlashAttention()
    else:
        backend = TorchAttention()
    log.info("attention backend: %s on %s (%s)", backend.name, device, dtype)
    return backend

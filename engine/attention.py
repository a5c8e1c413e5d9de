"""Paged attention behind one interface: a torch path everywhere, vllm-flash-attn on CUDA.

Lifecycle: `select_backend(name, device)` once at engine start picks and logs a backend.
Each step the model runner builds one `AttentionMetadata` for the flat batch (decode
sequences first, then prefill chunks); every layer writes its new K/V into the paged cache
at `slot_mapping` and calls `backend.attend` with its `LayerKv` views. Backends never
allocate cache blocks. An 8-bit cache is read unscaled through `LayerKv.read` (decode
applies its block scales to scores and probabilities) or dequantized through
`LayerKv.gather` (prefill); the flash kernel takes only an unquantized cache (it has no
per-block scales), so `select_backend` picks torch for an 8-bit one.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from engine.config import AttentionBackendName
from engine.kv_cache import LayerKv, lift_for
from engine.tiled_attention import MIN_QUERIES, tiled_causal_attention

if TYPE_CHECKING:  # numba loads only where a kernel runs: see select_backend
    from engine.row_attention import RowAttention, RowPlan

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
    plan: object = None  # the backend's per-step plan (see AttentionBackend.plan)
    kv_write: object = None  # the KV cache's per-step write plan (KvCache.plan_write)


class AttentionBackend(abc.ABC):
    """Computes attention for one layer over the paged cache.

    Preconditions: this step's K/V are already written into the layer's cache views
    (`LayerKv.k` and `.v`: [num_blocks, block_size, kv_heads, head_dim], page stride a
    whole block). `q` is [T, heads, head_dim].
    Returns [T, heads, head_dim]. No side effects.
    """

    name: str

    def plan(self, meta: AttentionMetadata, block_size: int, device: torch.device) -> object:
        """Work shared by all layers of one step (index tensors, masks); stored in meta.plan."""
        return None

    @abc.abstractmethod
    def attend(self, q: torch.Tensor, cache: LayerKv, meta: AttentionMetadata) -> torch.Tensor: ...


@dataclass
class _DecodeGroup:
    """Decode rows of similar context length, attended together."""

    rows: torch.Tensor  # [g] long: rows of q among the decodes
    blocks: torch.Tensor  # [g * nblocks] long: their block ids, flattened
    nblocks: int
    mask: torch.Tensor  # [g, 1, 1, nblocks * block_size] bool: real positions


@dataclass
class _PrefillSeq:
    start: int
    qlen: int
    seq_len: int
    blocks: torch.Tensor  # [nblocks] long, on the step's device
    _mask: torch.Tensor | None = None

    def sdpa_mask(self) -> torch.Tensor | None:
        """SDPA's additive float mask for a later chunk (None for a first one: causal).
        Built at the first layer that needs it and kept for the step's others; the
        tiled path never asks (at 512 queries over 8,192 keys it is 16 MB)."""
        if self._mask is None and self.qlen != self.seq_len:
            self._mask = _chunk_mask(self.qlen, self.seq_len, self.blocks.device)
        return self._mask


@dataclass
class _TorchPlan:
    decode_groups: list[_DecodeGroup]
    prefills: list[_PrefillSeq]
    # The compiled decode's offsets of each decode row's cached tokens and their
    # counts ([rows, longest], [rows]): built at the step's first layer, shared by all.
    bases: np.ndarray | None = None
    lens: np.ndarray | None = None
    # The row kernel's offsets (invariant float32 steps), built at the first layer.
    rows: RowPlan | None = None


class TorchAttention(AttentionBackend):
    """Gathers blocks and runs torch SDPA; CPU and CUDA.

    Per step (`plan`, once for all layers): decode rows are sorted by context length and
    cut into groups whose longest context is at most `GROUP_SPREAD` times the shortest,
    so a short sequence never pays for the longest one's padding; each group's blocks
    are flattened for one `index_select` per layer. Prefill chunks attend one sequence
    at a time; a later chunk of a chunked prefill gets an additive float mask so SDPA
    stays on its fused kernel.
    """

    name = "torch"
    GROUP_SPREAD = 1.5

    def __init__(
        self,
        compiled_decode: bool = False,
        *,
        invariant: bool = False,
        rows: RowAttention | None = None,
    ) -> None:
        """`compiled_decode`: decode rows over an unquantized bfloat16 cache on the CPU
        attend through `engine.decode_kernel.decode_attention`, which reads K and V in
        place in the pool, instead of gathering their blocks (copies) for two matmuls,
        which at long contexts are a large share of the step (docs/engine.md
        "Kernels"). `invariant`: each decode row attends alone, over its own blocks, so
        its bits do not depend on the other rows (a group pads every row to its longest
        context, and the padded length changes the products' order of summation).
        `rows`: every row of every step, decode or prefill, attends through this
        (`engine.row_attention`: a row's bits depend on its tokens alone); given for an
        invariant float32 engine on the CPU with an unquantized cache."""
        self.compiled_decode = compiled_decode
        self.invariant = invariant
        self.rows = rows
        self._pools: dict[int, np.ndarray] = {}  # the pool's bits by storage address

    def plan(self, meta: AttentionMetadata, block_size: int, device: torch.device) -> _TorchPlan:
        if self.rows is not None:  # the row kernel's plan needs the pool: first layer
            return _TorchPlan([], [])
        nd = meta.num_decodes
        groups = [
            self._group(meta, rows, block_size, device)
            for rows in self._buckets(meta.seq_lens_host[:nd])
        ]
        prefills = []
        start = sum(meta.query_lens_host[:nd])
        for i in range(nd, len(meta.query_lens_host)):
            qlen, seq_len = meta.query_lens_host[i], meta.seq_lens_host[i]
            nblocks = -(-seq_len // block_size)
            blocks = meta.block_table[i, :nblocks].long()
            prefills.append(_PrefillSeq(start, qlen, seq_len, blocks))
            start += qlen
        return _TorchPlan(groups, prefills)

    def _buckets(self, lens: list[int]) -> list[list[int]]:
        if self.invariant:
            return [[row] for row in range(len(lens))]
        order = sorted(range(len(lens)), key=lens.__getitem__)
        buckets: list[list[int]] = []
        for row in order:
            if buckets and lens[row] <= self.GROUP_SPREAD * lens[buckets[-1][0]]:
                buckets[-1].append(row)
            else:
                buckets.append([row])
        return buckets

    @staticmethod
    def _group(
        meta: AttentionMetadata, rows: list[int], bs: int, device: torch.device
    ) -> _DecodeGroup:
        nblocks = -(-max(meta.seq_lens_host[r] for r in rows) // bs)
        index = torch.tensor(rows, device=device)
        blocks = meta.block_table.index_select(0, index)[:, :nblocks].reshape(-1).long()
        positions = torch.arange(nblocks * bs, device=device)
        lens = meta.seq_lens.index_select(0, index)
        mask = (positions[None, :] < lens[:, None]).view(len(rows), 1, 1, -1)
        return _DecodeGroup(index, blocks, nblocks, mask)

    def attend(self, q: torch.Tensor, cache: LayerKv, meta: AttentionMetadata) -> torch.Tensor:
        plan = meta.plan
        assert isinstance(plan, _TorchPlan), "ModelRunner must call plan() once per step"
        if self.rows is not None:
            if plan.rows is None:
                lens = (meta.query_lens_host, meta.seq_lens_host)
                plan.rows = self.rows.plan(cache.kv, meta.block_table, *lens)
            return self.rows.attend(q, cache.kv, plan.rows)
        out = torch.empty_like(q)
        if self._compiles(q, cache) and meta.num_decodes:
            nd = meta.num_decodes
            out[:nd] = self._compiled_decode(q[:nd], cache, meta, plan)
        else:
            for group in plan.decode_groups:
                out[group.rows] = self._decode(q.index_select(0, group.rows), cache, group)
        for seq in plan.prefills:
            out[seq.start : seq.start + seq.qlen] = self._prefill(
                q[seq.start : seq.start + seq.qlen], cache, seq
            )
        return out

    def _compiles(self, q: torch.Tensor, cache: LayerKv) -> bool:
        return (
            self.compiled_decode
            and cache.scales is None
            and q.dtype == cache.kv.dtype == torch.bfloat16
            and q.device.type == "cpu"
        )

    def _compiled_decode(
        self, q: torch.Tensor, cache: LayerKv, meta: AttentionMetadata, plan: _TorchPlan
    ) -> torch.Tensor:
        """The decode rows' attention by the compiled kernel, reading the pool in place:
        a row's token p has its K row at element bases[p] + the layer view's own offset
        (V one K/V stride further)."""
        from engine import decode_kernel  # numba: loaded only where decode compiles

        kv = cache.kv  # [blocks, 2 (K, V), block_size, kv_heads, head_dim], strided
        nd, heads, hd = q.shape
        if plan.bases is None or plan.lens is None:  # the step's first layer
            plan.bases, plan.lens = self._bases(kv, meta, nd)
        attend = decode_kernel.decode_attention(heads, kv.shape[3], hd)
        qf = q.reshape(nd, heads * hd).float().numpy()
        out = np.empty_like(qf)
        k_off = kv.storage_offset()
        attend(qf, self._pool(kv), plan.bases, plan.lens, k_off, k_off + kv.stride(1), out)
        return torch.from_numpy(out).to(q.dtype).view(nd, heads, hd)

    @staticmethod
    def _bases(kv: torch.Tensor, meta: AttentionMetadata, nd: int) -> tuple[np.ndarray, np.ndarray]:
        """Offsets of the decode rows' cached tokens (IndexError for blocks outside the
        pool, `engine.row_attention.token_offsets`) and their counts."""
        from engine.row_attention import token_offsets

        lens = meta.seq_lens_host[:nd]
        return token_offsets(kv, meta.block_table[:nd].numpy(), lens), np.asarray(lens, np.int64)

    def _pool(self, kv: torch.Tensor) -> np.ndarray:
        """The whole pool under `kv`, as uint16 bits (one view per pool, kept)."""
        storage = kv.untyped_storage()
        key = storage.data_ptr()
        if key not in self._pools:
            flat = kv.as_strided((storage.nbytes() // kv.element_size(),), (1,), 0)
            self._pools[key] = flat.view(torch.int16).numpy().view(np.uint16)
        return self._pools[key]

    @staticmethod
    def _decode(q: torch.Tensor, cache: LayerKv, group: _DecodeGroup) -> torch.Tensor:
        g, heads, hd = q.shape
        kvh = cache.k.shape[2]
        # [g, kv_heads, keys, head_dim], contiguous: a transposed view cost a slow copy
        # inside each matmul, slower than the read itself.
        got = cache.read(group.blocks, q.dtype, seqs=g)
        # GQA without copying K/V: the query heads of one KV group become query rows.
        qg = q.view(g, kvh, heads // kvh, hd)
        if got.k_scale is not None and got.v_scale is not None:
            scales = (_per_block(got.k_scale, g), _per_block(got.v_scale, g))
            out = _decode_matmul(qg, got.k, got.v, group.mask, scales, got.exponent)
        elif q.dtype == torch.float32:
            out = F.scaled_dot_product_attention(qg, got.k, got.v, attn_mask=group.mask)
        else:
            out = _decode_matmul(qg, got.k, got.v, group.mask)
        return out.reshape(g, heads, hd)

    @staticmethod
    def _prefill(q: torch.Tensor, cache: LayerKv, seq: _PrefillSeq) -> torch.Tensor:
        _, _, hd = q.shape
        bs, kvh = cache.k.shape[1], cache.k.shape[2]
        nblocks = seq.blocks.shape[0]
        k, v = cache.gather(seq.blocks, q.dtype)
        k = k.view(nblocks * bs, kvh, hd)[: seq.seq_len]
        v = v.view(nblocks * bs, kvh, hd)[: seq.seq_len]
        # float32 keeps SDPA: its CPU kernel is what transformers runs (bit parity).
        if q.dtype == torch.bfloat16 and q.device.type == "cpu" and seq.qlen >= MIN_QUERIES:
            return tiled_causal_attention(q, k, v)
        # 4-D [1, heads, len, hd]: torch's CPU SDPA takes its fused (flash) kernel only for
        # batched 4-D inputs; 3-D falls back to the math path, which materialises every
        # score and is many times slower on long prompts.
        qh = q.transpose(0, 1).unsqueeze(0)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        mask = seq.sdpa_mask()
        if mask is None:
            out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)


def _decode_matmul(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    exponent: int = 0,
) -> torch.Tensor:
    """Decode attention as two batched matmuls in the model's dtype, softmax in fp32.

    Why not SDPA below fp32: for a handful of query rows per KV head, torch's CPU SDPA
    in bf16 is slower than this at every context length measured; in fp32 the two are
    even, and SDPA stays for fp32's bit parity with HF. Measurements: docs/engine.md
    "Precision".

    With an 8-bit cache, `k` and `v` are its unscaled values and `scales` the K and V
    block scales as [g, kv_heads, 1, blocks, 1] (see `_per_block`): q.(s k) = s (q.k)
    scales the scores, and sum p (s v) = sum (p s) v the probabilities, each viewed as
    [..., blocks, block_size] so that a block's scale broadcasts over its keys.

    K and V read as their values times 2**exponent (an fp8 cache in bfloat16) are
    matched by `lift` on the query and the probabilities, and again on each product:
    powers of two, so exact.
    """
    lift = lift_for(exponent)
    if lift != 1.0:
        q = q * lift
    scores = torch.matmul(q, k.transpose(-1, -2)).float()
    if scales is not None:
        _by_block(scores, scales[0]).mul_(scales[0])
    scores.mul_(q.shape[-1] ** -0.5 * lift).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if scales is not None:  # lift rides on the (small) V scales, not on every probability
        v_scale = scales[1] if lift == 1.0 else scales[1] * lift
        _by_block(probs, v_scale).mul_(v_scale)
    elif lift != 1.0:
        probs.mul_(lift)
    out = torch.matmul(probs.to(v.dtype), v)
    return out if lift == 1.0 else out.mul_(lift)


def _per_block(scale: torch.Tensor, g: int) -> torch.Tensor:
    """[g * nblocks, kv_heads] block scales as a [g, kv_heads, 1, nblocks, 1] view, which
    broadcasts over `_by_block` views of scores (no per-key copy)."""
    return scale.view(g, -1, scale.shape[-1]).transpose(1, 2)[:, :, None, :, None]


def _by_block(x: torch.Tensor, per_block: torch.Tensor) -> torch.Tensor:
    """[g, kv_heads, rows, keys] as [g, kv_heads, rows, blocks, block_size] (a view)."""
    return x.view(*x.shape[:-1], per_block.shape[-2], -1)


def _chunk_mask(qlen: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """Additive mask of a later prefill chunk: query i sits at position seq_len - qlen + i."""
    qpos = torch.arange(seq_len - qlen, seq_len, device=device)
    kpos = torch.arange(seq_len, device=device)
    mask = torch.zeros(qlen, seq_len, device=device)
    return mask.masked_fill_(kpos[None, :] > qpos[:, None], float("-inf"))


class FlashAttention(AttentionBackend):
    """vllm-flash-attn's paged varlen kernel (CUDA only; an optional extra)."""

    name = "flash"

    def __init__(self) -> None:
        from vllm_flash_attn import flash_attn_varlen_func

        self._fn = flash_attn_varlen_func

    def attend(self, q: torch.Tensor, cache: LayerKv, meta: AttentionMetadata) -> torch.Tensor:
        if cache.quantized:
            raise RuntimeError("the flash backend reads an unquantized KV cache only")
        # The views' page stride is a whole block (every layer's K and V); the kernel
        # reads it from k.stride(0) and needs only head_dim contiguous.
        out: torch.Tensor = self._fn(
            q=q,
            k=cache.k,
            v=cache.v,
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


def select_backend(
    choice: AttentionBackendName | str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    quantized_kv: bool = False,
    compiled_decode: bool = False,
    invariant: bool = False,
) -> AttentionBackend:
    """`auto` takes flash on CUDA with fp16/bf16 and an unquantized cache when it
    imports, torch otherwise. `compiled_decode` and `invariant` go to `TorchAttention`;
    an invariant float32 engine on the CPU with an unquantized cache attends by rows
    (`engine.row_attention`)."""
    name = AttentionBackendName(choice)
    if name is AttentionBackendName.FLASH and quantized_kv:
        raise ValueError("attention backend 'flash' needs kv_cache_dtype auto (no 8-bit KV)")
    want_flash = name is AttentionBackendName.FLASH or (
        name is AttentionBackendName.AUTO
        and dtype in (torch.float16, torch.bfloat16)
        and not quantized_kv
        and flash_available(device)
    )
    if want_flash:
        if not flash_available(device):
            raise RuntimeError("attention backend 'flash' needs CUDA and vllm-flash-attn")
        backend: AttentionBackend = FlashAttention()
    else:
        # Rows alone where their kernel covers the cache: float32 on the CPU, unscaled.
        by_row = invariant and dtype == torch.float32 and device.type == "cpu" and not quantized_kv
        rows = None
        if by_row:
            from engine.row_attention import RowAttention

            rows = RowAttention(torch.get_num_threads())
        backend = TorchAttention(compiled_decode, invariant=invariant, rows=rows)
    log.info("attention backend: %s on %s (%s)", backend.name, device, dtype)
    return backend

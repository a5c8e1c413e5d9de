"""The engine's one paged KV pool, block-major, and the layout peers must agree on.

Lifecycle: at engine start `KvLayout.from_spec` describes a block, `blocks_for_budget`
turns the memory budget into a block count, and `KvCache(layout, n, device)` allocates
the pool that lives as long as the engine. Each step the model runner asks
`plan_write(slot_mapping)` once; every layer then calls `write` with its new K/V and
reads `layer(i)` (strided views, no copies) for attention. KV transfer, forks and the
offload tier move whole blocks through `blocks` ([num_blocks, bytes_per_block] bytes).

Why block-major ([blocks, layers, K/V, block_size, kv_heads, head_dim]): one block's KV
for every layer is one contiguous region, so a scattered import is one NIXL descriptor
per block instead of one per (layer, K/V, block). The layout-major pool it replaced
(`[layers, K/V, blocks, ...]`) cut a SmolLM2 block into 60 separate 12 KB pieces, and a
scattered 8,192-token import ran at 0.24x memcpy. Per-layer views keep the page stride
of a whole block, which vllm-flash-attn's paged kernel accepts (it takes the stride of
dimension 0 as the page stride and needs only the head dimension contiguous).

An 8-bit cache (`KvCacheDType.INT8`, `FP8_E4M3`) stores a float32 scale per (block,
layer, K/V, KV head) after the block's data, inside the same region, so scales move
with their blocks over NIXL and TCP. A scale only grows: when a token needs a larger
one, the block's earlier tokens are re-expressed in it; a block written from offset 0
starts afresh (its old bytes belong to a previous owner).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import xxhash

from engine.model_spec import ModelSpec

#: Bumped when the pool's tensor layout changes; part of the layout fingerprint.
#: 1: layer-major [layers, K/V, blocks, ...]; 2: block-major with in-block scales.
KV_LAYOUT_VERSION = 2
_MADV_HUGEPAGE = 14
_SCALE_BYTES = 4  # float32

#: Largest magnitude each 8-bit format stores (int8 symmetric; e4m3fn's finite max).
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
#: Same-width integer types the 8-bit data is copied through (torch's CPU index_copy_
#: has no float8 kernel; copying bits is exact).
_BITS = {torch.int8: torch.int8, torch.float8_e4m3fn: torch.uint8}
#: The smallest scale; keeps an all-zero head's division finite.
_MIN_SCALE = 1e-12


@dataclass(frozen=True)
class KvLayout:
    """Everything that must match for two engines to share KV blocks byte for byte."""

    model_fingerprint: str
    dtype: str  # the stored dtype: the compute dtype, int8 or float8_e4m3fn
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    memory_kind: str  # "cpu" or "cuda"

    @classmethod
    def from_spec(
        cls, spec: ModelSpec, dtype: torch.dtype, block_size: int, device: torch.device
    ) -> KvLayout:
        return cls(
            model_fingerprint=spec.fingerprint,
            dtype=str(dtype).removeprefix("torch."),
            block_size=block_size,
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            memory_kind=device.type,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    @property
    def quantized(self) -> bool:
        return self.torch_dtype in _QMAX

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def row_bytes(self) -> int:
        """One token's K (or V) in one layer: the unit the pool is addressed in."""
        return self.num_kv_heads * self.head_dim * self.element_size

    @property
    def data_rows(self) -> int:
        """Rows of K/V data in a block: every layer, K then V, `block_size` tokens each."""
        return self.num_layers * 2 * self.block_size

    @property
    def scale_bytes(self) -> int:
        """The block's scales (8-bit caches only): one per layer, K/V and KV head."""
        return self.num_layers * 2 * self.num_kv_heads * _SCALE_BYTES if self.quantized else 0

    @property
    def rows_per_block(self) -> int:
        """Data rows plus the rows the scales occupy, rounded up to whole rows."""
        return self.data_rows + -(-self.scale_bytes // self.row_bytes)

    @property
    def bytes_per_block(self) -> int:
        return self.rows_per_block * self.row_bytes

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers, scales included (rounded down)."""
        return self.bytes_per_block // self.block_size

    def fingerprint(self) -> str:
        """Stable id of this layout: peers compare it at handshake and refuse a mismatch."""
        text = (
            f"v{KV_LAYOUT_VERSION}|{self.model_fingerprint}|{self.dtype}|{self.block_size}|"
            f"{self.num_layers}|{self.num_kv_heads}|{self.head_dim}|{self.memory_kind}"
        )
        return xxhash.xxh3_64_hexdigest(text.encode())


def blocks_for_budget(layout: KvLayout, budget_bytes: int) -> int:
    """How many blocks fit in the budget; at least one, or a clear error."""
    n = budget_bytes // layout.bytes_per_block
    if n < 1:
        raise ValueError(
            f"kv_cache_bytes={budget_bytes} is below one block ({layout.bytes_per_block} bytes)"
        )
    return n


@dataclass(frozen=True)
class LayerKv:
    """One layer's K and V as [num_blocks, block_size, kv_heads, head_dim] strided views
    of the pool (page stride: a whole block), with [num_blocks, kv_heads] float32 scales
    for an 8-bit cache (None otherwise)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def gather(self, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `blocks` ([n] long) as new [n, block_size, kv_heads, head_dim]
        tensors in `dtype`, dequantized when the cache is 8-bit."""
        k, v, k_scale, v_scale = self.gather_unscaled(blocks, dtype)
        if k_scale is None or v_scale is None:
            return k, v
        return _scale(k, k_scale), _scale(v, v_scale)

    def gather_unscaled(
        self, blocks: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """K and V of `blocks` cast to `dtype` but not yet multiplied by their scales,
        and the [n, kv_heads] float32 scales (None, None when unquantized).

        Why: decode attention applies a block's scale to its scores and probabilities
        (head_dim times fewer elements than its keys and values), which saves a whole
        pass over the gathered cache per layer."""
        k, v = _select(self.k, blocks).to(dtype), _select(self.v, blocks).to(dtype)
        if self.k_scale is None or self.v_scale is None:
            return k, v, None, None
        return k, v, self.k_scale.index_select(0, blocks), self.v_scale.index_select(0, blocks)


@dataclass(frozen=True)
class KvWrite:
    """Where one step's new tokens go, shared by every layer (from `plan_write`).

    `rows` is each token's row of layer 0's K. An 8-bit cache also needs the distinct
    blocks the step writes (`blocks`), each token's index among them (`inverse`), and
    which of them the step starts at offset 0 (`fresh`: their old scales are void).
    """

    rows: torch.Tensor  # [T] long
    blocks: torch.Tensor | None = None  # [U] long
    inverse: torch.Tensor | None = None  # [T] long; None: token t writes blocks[t]
    fresh: torch.Tensor | None = None  # [U] bool


class KvCache:
    """The pool: `blocks` is what moves between engines; the rest are views of it."""

    def __init__(self, layout: KvLayout, num_blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.blocks = allocate_blocks(layout, num_blocks, device)
        lay = layout
        stored = lay.torch_dtype
        bits = _BITS.get(stored, stored)
        heads = (lay.num_kv_heads, lay.head_dim)
        #: Every row of the pool in the dtype writes go through (8-bit: integer bits).
        self._rows = self.blocks.view(bits).view(-1, *heads)
        per_block = self.blocks.view(stored).view(num_blocks, lay.rows_per_block, *heads)
        data = per_block[:, : lay.data_rows].view(
            num_blocks, lay.num_layers, 2, lay.block_size, *heads
        )
        self.scales: torch.Tensor | None = None
        if lay.quantized:
            start = lay.data_rows * lay.row_bytes
            raw = self.blocks[:, start : start + lay.scale_bytes]
            self.scales = raw.view(torch.float32).view(num_blocks, lay.num_layers, 2, -1)
        self._data = data
        self._layers = [self._layer_views(data, i) for i in range(lay.num_layers)]

    def _layer_views(self, data: torch.Tensor, i: int) -> LayerKv:
        scales = self.scales
        if scales is None:
            return LayerKv(data[:, i, 0], data[:, i, 1], None, None)
        return LayerKv(data[:, i, 0], data[:, i, 1], scales[:, i, 0], scales[:, i, 1])

    def layer(self, i: int) -> LayerKv:
        return self._layers[i]

    def plan_write(self, slot_mapping: torch.Tensor) -> KvWrite:
        """Once per step: turn flat slots (block * block_size + offset) into pool rows."""
        bs = self.layout.block_size
        block, offset = slot_mapping.div(bs, rounding_mode="floor"), slot_mapping.remainder(bs)
        rows = block * self.layout.rows_per_block + offset
        if not self.layout.quantized:
            return KvWrite(rows)
        blocks, inverse = torch.unique(block, return_inverse=True)
        if len(blocks) == len(block):
            # Every token in its own block (a decode-only step): no scatter needed.
            return KvWrite(rows, block, None, offset == 0)
        first = torch.full_like(blocks, bs).scatter_reduce_(0, inverse, offset, "amin")
        return KvWrite(rows, blocks, inverse, first == 0)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: KvWrite) -> None:
        """Store this step's K and V ([T, kv_heads, head_dim]) of `layer`."""
        bs = self.layout.block_size
        if self.scales is None:
            self._rows.index_copy_(0, plan.rows + 2 * layer * bs, k.to(self._rows.dtype))
            self._rows.index_copy_(0, plan.rows + (2 * layer + 1) * bs, v.to(self._rows.dtype))
            return
        self._write_8bit(layer, torch.stack((k, v)).float(), plan)

    def _write_8bit(self, layer: int, x: torch.Tensor, plan: KvWrite) -> None:
        """Quantize [2 (K, V), T, kv_heads, head_dim] into the step's blocks of `layer`:
        grow each touched (block, K/V, head) scale to cover its new tokens, re-express
        the block's earlier tokens where it grew, then write the new ones."""
        assert self.scales is not None
        assert plan.blocks is not None and plan.fresh is not None
        stored, bs = self.layout.torch_dtype, self.layout.block_size
        scale = self.scales[:, layer]  # [N, 2, kv_heads]
        needed = x.abs().amax(-1).transpose(0, 1)  # [T, 2, kv_heads]
        if plan.inverse is not None:  # tokens share blocks: each block's largest
            index = plan.inverse[:, None, None].expand_as(needed)
            per_block = torch.zeros(len(plan.blocks), *needed.shape[1:], device=x.device)
            needed = per_block.scatter_reduce_(0, index, needed, "amax")
        old = scale.index_select(0, plan.blocks).masked_fill_(plan.fresh[:, None, None], 0.0)
        new = torch.maximum(old, needed.div_(_QMAX[stored])).clamp_min_(_MIN_SCALE)
        self._rescale(self._data[:, layer], plan.blocks, old, new)
        scale.index_copy_(0, plan.blocks, new)
        per_token = new if plan.inverse is None else new.index_select(0, plan.inverse)
        per_token = per_token.transpose(0, 1)[..., None]
        q = _quantize(x.div_(per_token), stored)
        rows = torch.cat((plan.rows + 2 * layer * bs, plan.rows + (2 * layer + 1) * bs))
        self._rows.index_copy_(0, rows, q.flatten(0, 1).view(self._rows.dtype))

    def _rescale(
        self, data: torch.Tensor, blocks: torch.Tensor, old: torch.Tensor, new: torch.Tensor
    ) -> None:
        """Re-express the tokens already in `blocks` ([N, 2, block_size, heads, dim]
        data of one layer) in their grown [U, 2, heads] scales.

        Only blocks whose scale grew are touched; a fresh block (old 0) is zeroed, which
        also clears the previous owner's bytes.
        """
        grew = (old < new).flatten(1).any(dim=1).nonzero().squeeze(1)
        if grew.numel() == 0:
            return
        ratio = (old.index_select(0, grew) / new.index_select(0, grew))[:, :, None, :, None]
        which = blocks.index_select(0, grew)
        values = _select(data, which).float().mul_(ratio)
        bits = _BITS[self.layout.torch_dtype]
        data.view(bits).index_copy_(0, which, _quantize(values, self.layout.torch_dtype).view(bits))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one whole block (every layer, K and V, scales) onto another."""
        self.blocks[dst] = self.blocks[src]


def _select(data: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """index_select along blocks; 8-bit float data goes through its integer bits."""
    bits = _BITS.get(data.dtype)
    if bits is None or bits == data.dtype:
        return data.index_select(0, blocks)
    return data.view(bits).index_select(0, blocks).view(data.dtype)


def _quantize(x: torch.Tensor, stored: torch.dtype) -> torch.Tensor:
    """Scaled float values (|x| <= qmax) to the 8-bit dtype, rounding to nearest."""
    qmax = _QMAX[stored]
    if stored == torch.int8:
        return x.round_().clamp_(-qmax, qmax).to(torch.int8)
    return x.clamp_(-qmax, qmax).to(stored)


def _scale(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[n, block_size, heads, head_dim] cast 8-bit values times their [n, heads] scales."""
    return values.mul_(scale.to(values.dtype)[:, None, :, None])


def allocate_blocks(layout: KvLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
    """A zeroed [num_blocks, bytes_per_block] byte pool (huge pages asked for on CPU)."""
    if layout.row_bytes % _SCALE_BYTES:
        raise ValueError(f"KV rows of {layout.row_bytes} bytes cannot hold aligned scales")
    pool = torch.empty(num_blocks, layout.bytes_per_block, dtype=torch.uint8, device=device)
    if device.type == "cpu":
        _advise_huge_pages(pool)
    # Zeroed, not left empty: padding slots read by batched attention must hold finite
    # values, and touching every page now keeps page faults out of the first transfers.
    return pool.zero_()


def _advise_huge_pages(pool: torch.Tensor) -> None:
    """Ask Linux for transparent huge pages before first touch (best effort).

    Bulk KV copies between processes (NIXL over CMA) ran about a third faster from
    huge-page-backed pools on 2-core hosts: fewer TLB misses and page walks.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    page = 4096
    start = -(-pool.data_ptr() // page) * page
    end = (pool.data_ptr() + pool.numel()) // page * page
    if end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)

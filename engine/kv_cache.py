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
(`[layers, K/V, blocks, ...]`) cut a SmolLM2 block into 60 separate 12 KB pieces, and
scattered imports ran at a fraction of memcpy's speed (docs/engine.md "Paged KV cache
and prefix cache"). Per-layer views keep the page stride of a whole block, which
vllm-flash-attn's paged kernel accepts (it takes the stride of dimension 0 as the page
stride and needs only the head dimension contiguous).

An 8-bit cache (`KvCacheDType.INT8`, `FP8_E4M3`) stores a float32 scale per (block,
layer, K/V, KV head) after the block's data, inside the same region, so scales move
with their blocks over NIXL and TCP. A scale only grows: when a token needs a larger
one, the block's earlier tokens are re-expressed in it; a block written from offset 0
starts afresh (its old bytes belong to a previous owner).

Reading an 8-bit cache costs one pass more than an unquantized one, not a slow cast:
int8 values convert to the compute dtype directly, and fp8 values are moved bit for bit
into bfloat16 (`_as_dtype`), because torch's CPU float8 cast is a scalar loop, far
slower than the integer pass (docs/engine.md "8-bit KV cache"). That makes an fp8 value
read in bfloat16 come back as the stored value times 2**-120 (`GatheredKv.exponent`);
attention carries the power of two through its matmuls (`lift_for`), so nothing is lost.
An fp8 cache written by this version stores no subnormal numbers (values under e4m3's
smallest normal, 2**-6 of a block's scale, are stored as zero: far below the format's
own rounding at the top of its range), so its reads meet no denormal float, whose
handling differs between CPUs (blocks from an older peer may hold some: they read
exactly, or as zero where a CPU flushes denormals; either is far below the format's
rounding). e4m3's NaN codes read as +-480 times the scale, not NaN: a healthy model
never stores them (the write clamps finite values to +-448).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.kv_layout import QMAX, SCALE_BYTES, KvLayout, allocate_blocks

if TYPE_CHECKING:
    from engine.kv_quant_kernel import QuantWriter

_log = logging.getLogger(__name__)
#: The integer type 8-bit data is copied and read through (torch's CPU index_copy_ has
#: no float8 kernel; copying bits is exact; signed, so widening keeps fp8's sign bit).
_BITS = {torch.int8: torch.int8, torch.float8_e4m3fn: torch.int8}
#: fp8 e4m3 read as bfloat16: its sign to bit 15, exponent and mantissa to bits 10-4.
#: With e4m3's exponent field in the low bits of bfloat16's, the number read is the
#: stored one times 2**(7 - 127).
_FP8_READ_EXPONENT = -120
_FP8_BF16_MASK = -0x7810  # 0x87F0 as int16: sign bit plus bits 10-4
_FP8_MIN_NORMAL = 2.0**-6
#: Scaled values at most this small are stored as zero: just under the smallest normal,
#: which itself stays.
_FP8_FLUSH = _FP8_MIN_NORMAL * (1 - 2.0**-10)
#: How far past its new tokens a scale that must grow is set, in a block that will take
#: more tokens. e4m3 keeps its relative precision at any magnitude, so 8x costs only a
#: higher zero floor and spares nearly every re-expression. int8's steps are even, so
#: headroom costs resolution: even a little lowered greedy continuations' agreement
#: with the unquantized cache (docs/engine.md "8-bit KV cache"), so int8 gets none.
_HEADROOM = {torch.int8: 1.0, torch.float8_e4m3fn: 8.0}
#: The smallest scale; keeps an all-zero head's division finite.
_MIN_SCALE = 1e-12


@dataclass(frozen=True)
class GatheredKv:
    """K and V read for attention, not yet multiplied by their scales.

    `k` and `v` hold the stored values times 2**`exponent` (0, or -120 for an fp8 cache
    read in bfloat16); `k_scale` and `v_scale` are the blocks' [n, kv_heads] float32
    scales, None when the cache is unquantized."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    exponent: int = 0


@dataclass(frozen=True)
class LayerKv:
    """One layer's K and V: `kv` is a [num_blocks, 2 (K, V), block_size, kv_heads,
    head_dim] strided view of the pool (page stride: a whole block) and `scales` the
    [num_blocks, 2, kv_heads] float32 scales of an 8-bit cache (None otherwise).

    K and V of a layer sit side by side in a block, so one read takes both: per layer
    and decode group that is one index_select and one conversion, not two of each (each
    op costs microseconds of overhead, and a decode step runs thousands)."""

    kv: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def k(self) -> torch.Tensor:
        return self.kv[:, 0]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, 1]

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def gather(self, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `blocks` ([n] long) as new [n, block_size, kv_heads, head_dim]
        tensors in `dtype`, dequantized when the cache is 8-bit."""
        got = self.read(blocks, dtype)
        if got.k_scale is None or got.v_scale is None:
            return got.k, got.v
        return _scale(got.k, got.k_scale, got.exponent), _scale(got.v, got.v_scale, got.exponent)

    def read(self, blocks: torch.Tensor, dtype: torch.dtype, seqs: int | None = None) -> GatheredKv:
        """K and V of `blocks` ([n] long) in `dtype`, unscaled, as contiguous tensors:
        token-major [n, block_size, kv_heads, head_dim]; or, given `seqs` (the blocks are
        that many equal runs, one sequence each), head-major [seqs, kv_heads, n // seqs *
        block_size, head_dim], which decode attention's matmuls take without a copy.

        Why unscaled: decode attention applies a block's scale to its scores and
        probabilities (head_dim times fewer elements than its keys and values), which
        saves a whole pass over the gathered cache per layer."""
        kv, exponent = _read(self.kv, blocks, dtype, seqs)
        if self.scales is None:
            return GatheredKv(kv[0], kv[1])
        scales = self.scales.index_select(0, blocks)
        return GatheredKv(kv[0], kv[1], scales[:, 0], scales[:, 1], exponent)


@dataclass(frozen=True)
class KvWrite:
    """Where one step's new tokens go, shared by every layer (from `plan_write`).

    `rows` is each token's row of layer 0's K. An 8-bit cache written by the compiled
    kernel (CPU) needs each token's block and offset (`token_blocks`, `offsets`). One
    written by torch (GPU) needs instead each token's
    rows of layer 0's K then V (`kv_rows`), the distinct blocks the step writes
    (`blocks`), each token's index among them (`inverse`), and the headroom a scale that
    must grow gets in each (`room`: 1 where this step writes the block's last slot, which
    then usually takes no more tokens; rejected drafts can leave it open, costing only a
    later re-expression; None where the cache's dtype takes no headroom, int8).
    """

    rows: torch.Tensor  # [T] long
    kv_rows: torch.Tensor | None = None  # [2T] long
    blocks: torch.Tensor | None = None  # [U] long
    inverse: torch.Tensor | None = None  # [T] long; None: token t writes blocks[t]
    room: torch.Tensor | None = None  # [U] float32; None: no headroom anywhere
    #: The compiled write's plan instead (`QuantWriter`): each token's block and offset.
    token_blocks: torch.Tensor | None = None  # [T] long
    offsets: torch.Tensor | None = None  # [T] long


class KvCache:
    """The pool: `blocks` is what moves between engines; the rest are views of it."""

    def __init__(
        self, layout: KvLayout, num_blocks: int, device: torch.device, compiled: bool = True
    ) -> None:
        """`compiled` False keeps an 8-bit cache on CPU on the torch write (tests compare
        the two); an 8-bit cache elsewhere always writes through torch."""
        self.layout = layout
        self.blocks = allocate_blocks(layout, num_blocks, device)
        lay = layout
        stored = lay.torch_dtype
        bits = _BITS.get(stored, stored)
        heads = (lay.num_kv_heads, lay.head_dim)
        #: Every row of the pool (one token's K or V of one layer) as the widest integer
        #: words that divide it: writes copy whole words (see `_as_words`).
        self._rows = _as_words(self.blocks.view(bits).view(-1, lay.num_kv_heads * lay.head_dim))
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
        self._writer = self._quant_writer() if compiled and device.type == "cpu" else None

    def _quant_writer(self) -> QuantWriter | None:
        """The compiled 8-bit write over numpy views of this pool (None if unquantized,
        or if numba cannot load or compile the kernel: the torch write then serves)."""
        if self.scales is None:
            return None
        lay = self.layout
        try:
            from engine.kv_quant_kernel import FP8, INT8, QuantWriter  # numba: 8-bit only

            return QuantWriter(
                pool=self.blocks.view(torch.int8).numpy(),
                scales=self.blocks.view(torch.float32).numpy(),
                block_size=lay.block_size,
                scale_base=lay.data_rows * lay.row_bytes // SCALE_BYTES,
                kind=INT8 if lay.torch_dtype == torch.int8 else FP8,
                qmax=QMAX[lay.torch_dtype],
                headroom=_HEADROOM[lay.torch_dtype],
                min_scale=_MIN_SCALE,
                flush=_FP8_FLUSH,
            )
        except Exception as exc:  # e.g. no writable cache directory for numba's kernels
            _log.warning("8-bit KV write falls back to torch (slower): %s", exc)
            return None

    @property
    def quant_writer(self) -> QuantWriter | None:
        """The compiled 8-bit write this cache uses (None: unquantized, or torch's write),
        for the fused decode, which writes through it too."""
        return self._writer

    def _layer_views(self, data: torch.Tensor, i: int) -> LayerKv:
        return LayerKv(data[:, i], None if self.scales is None else self.scales[:, i])

    def layer(self, i: int) -> LayerKv:
        return self._layers[i]

    def plan_write(self, slot_mapping: torch.Tensor) -> KvWrite:
        """Once per step: turn flat slots (block * block_size + offset) into pool rows.

        An 8-bit cache also zeroes the blocks this step starts at offset 0, scales
        included: their bytes and scales belong to a previous owner."""
        bs = self.layout.block_size
        block, offset = slot_mapping.div(bs, rounding_mode="floor"), slot_mapping.remainder(bs)
        rows = block * self.layout.rows_per_block + offset
        if not self.layout.quantized:
            return KvWrite(rows)
        if self._writer is not None:
            self._check_blocks(block)
        fresh = block[offset == 0]
        if len(fresh):
            self.blocks.index_fill_(0, fresh, 0)
        if self._writer is not None:
            return KvWrite(rows, token_blocks=block, offsets=offset)
        kv_rows = torch.cat((rows, rows + bs))
        blocks, inverse = torch.unique(block, return_inverse=True)
        if len(blocks) == len(block):
            # Every token in its own block (a decode-only step): no scatter needed.
            last, shared = offset, None
        else:
            last = torch.zeros_like(blocks).scatter_reduce_(0, inverse, offset, "amax")
            shared = inverse
            block = blocks
        headroom = _HEADROOM[self.layout.torch_dtype]
        room = None if headroom == 1.0 else torch.where(last == bs - 1, 1.0, headroom)
        return KvWrite(rows, kv_rows, block, shared, room)

    def _check_blocks(self, block: torch.Tensor) -> None:
        """Refuse block ids outside the pool before the compiled write, which has no
        bounds checks (torch's index ops raise on their own)."""
        if len(block) and not 0 <= int(block.min()) <= int(block.max()) < len(self.blocks):
            raise IndexError(f"KV write to a block outside the pool of {len(self.blocks)}")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: KvWrite) -> None:
        """Store this step's K and V ([T, kv_heads, head_dim]) of `layer`."""
        bs = self.layout.block_size
        if self.scales is None:
            stored = self.layout.torch_dtype
            self._rows.index_copy_(
                0, plan.rows + 2 * layer * bs, _words_as(k.to(stored), self._rows)
            )
            self._rows.index_copy_(
                0, plan.rows + (2 * layer + 1) * bs, _words_as(v.to(stored), self._rows)
            )
            return
        x = torch.stack((k, v)).float()
        if self._writer is not None:
            assert plan.token_blocks is not None and plan.offsets is not None
            self._writer.write(layer, x, plan.token_blocks, plan.offsets)
            return
        self._write_8bit(layer, x, plan)

    def _write_8bit(self, layer: int, x: torch.Tensor, plan: KvWrite) -> None:
        """Quantize [2 (K, V), T, kv_heads, head_dim] into the step's blocks of `layer`:
        grow each touched (block, K/V, head) scale to cover its new tokens, re-express
        the block's earlier tokens where it grew, then write the new ones."""
        assert self.scales is not None
        assert plan.blocks is not None and plan.kv_rows is not None
        stored, bs = self.layout.torch_dtype, self.layout.block_size
        scale = self.scales[:, layer]  # [N, 2, kv_heads]
        needed = x.abs().amax(-1).transpose(0, 1)  # [T, 2, kv_heads]
        if plan.inverse is not None:  # tokens share blocks: each block's largest
            index = plan.inverse[:, None, None].expand_as(needed)
            per_block = torch.zeros(len(plan.blocks), *needed.shape[1:], device=x.device)
            needed = per_block.scatter_reduce_(0, index, needed, "amax")
        needed.div_(QMAX[stored])
        old = scale.index_select(0, plan.blocks)  # 0 in a fresh block (plan_write)
        over = needed > old
        grown = needed if plan.room is None else needed.mul_(plan.room[:, None, None])
        new = torch.where(over, grown, old).clamp_min_(_MIN_SCALE)
        self._rescale(self._data[:, layer], plan.blocks, old, new, over)
        scale.index_copy_(0, plan.blocks, new)
        per_token = new if plan.inverse is None else new.index_select(0, plan.inverse)
        per_token = per_token.transpose(0, 1)[..., None]
        q = _quantize(x.div_(per_token), stored)
        rows = plan.kv_rows + 2 * layer * bs
        self._rows.index_copy_(0, rows, _words_as(q.flatten(0, 1).view(_BITS[stored]), self._rows))

    def _rescale(
        self,
        data: torch.Tensor,
        blocks: torch.Tensor,
        old: torch.Tensor,
        new: torch.Tensor,
        over: torch.Tensor,
    ) -> None:
        """Re-express the tokens already in `blocks` ([N, 2, block_size, heads, dim]
        data of one layer) in their grown [U, 2, heads] scales.

        Only blocks holding tokens (old scale above 0) whose scale had to grow (`over`)
        are touched. The headroom an fp8 scale gets (`KvWrite.room`) makes this rare
        there; an int8 cache re-expresses some block in most decode steps.
        """
        held = over.logical_and_(old > 0)
        if not bool(held.any()):  # the common case, decided in two ops
            return
        grew = held.flatten(1).any(dim=1).nonzero().squeeze(1)
        ratio = (old.index_select(0, grew) / new.index_select(0, grew))[:, :, None, :, None]
        which = blocks.index_select(0, grew)
        stored = self.layout.torch_dtype
        bits = _BITS[stored]
        words = _as_words(data.view(bits).flatten(1))  # whole rows: see `_read`
        held_bits = words.index_select(0, which).view(bits).view(-1, *data.shape[1:])
        values, _ = _as_dtype(held_bits, stored, torch.float32)
        q = _quantize(values.mul_(ratio), stored).view(bits)
        words.index_copy_(0, which, _words_as(q, words))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one whole block (every layer, K and V, scales) onto another."""
        self.blocks[dst] = self.blocks[src]


def _read(
    kv: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype, seqs: int | None
) -> tuple[torch.Tensor, int]:
    """One layer's K and V ([num_blocks, 2, block_size, heads, dim] view) of `blocks` in
    `dtype` as one [2, ...] tensor (see `LayerKv.read`), and the power of two it is
    scaled by."""
    n, (_, bs, heads, dim) = len(blocks), kv.shape[1:]
    stored = kv.dtype
    bits = _BITS.get(stored, stored)
    # index_select of whole rows (a block's K and V are contiguous) in wide words: torch's
    # 5-D index_select of a strided view takes a slower path, and narrow elements too.
    raw = _as_words(kv.view(bits).flatten(1)).index_select(0, blocks).view(bits)
    if seqs is None:
        return _as_dtype(raw.view(n, 2, bs, heads, dim).transpose(0, 1), stored, dtype)
    per_seq = raw.view(seqs, n // seqs, 2, bs, heads, dim).permute(2, 0, 4, 1, 3, 5)
    values, exponent = _as_dtype(per_seq, stored, dtype)
    return values.view(2, seqs, heads, -1, dim), exponent


def _as_dtype(
    raw: torch.Tensor, stored: torch.dtype, dtype: torch.dtype
) -> tuple[torch.Tensor, int]:
    """Values of `stored` held in `raw` (their integer bits when 8-bit; any strides) as a
    new contiguous tensor in `dtype`, and the power of two they come back scaled by."""
    if stored != torch.float8_e4m3fn:
        return _contiguous_as(raw, dtype), 0
    wide = _contiguous_as(raw, torch.int16)  # sign-extended
    values = wide.bitwise_left_shift_(4).bitwise_and_(_FP8_BF16_MASK).view(torch.bfloat16)
    if dtype == torch.bfloat16:
        return values, _FP8_READ_EXPONENT
    return values.float().mul_(2.0**-_FP8_READ_EXPONENT).to(dtype), 0


def _as_words(rows: torch.Tensor) -> torch.Tensor:
    """A 2-D `rows` tensor (each row contiguous) viewed as the widest integers (up to 8
    bytes) that divide its rows, its row stride and its offset; itself when none do.

    Why: torch's CPU index_copy_ and index_select move one element at a time, so the
    fewer and wider the elements, the faster a block row is written or read
    (measurements: docs/engine.md "Kernels")."""
    for words in (torch.int64, torch.int32, torch.int16):
        if words.itemsize > rows.element_size() and _fits(rows, words):
            return rows.view(words)
    return rows


def _fits(rows: torch.Tensor, words: torch.dtype) -> bool:
    """Whether 2-D `rows` can be viewed as `words`: each row is contiguous, and its
    length, row stride and offset in bytes are whole words."""
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        return False
    size = rows.element_size()
    spans = (rows.shape[1] * size, rows.stride(0) * size, rows.storage_offset() * size)
    return all(span % words.itemsize == 0 for span in spans)


def _words_as(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`x` ([n, ...], of the same bytes per row as `like`) as [n, row words] of
    `like`'s dtype, for copying into rows made by `_as_words`."""
    flat = x.reshape(x.shape[0], math.prod(x.shape[1:]))
    if flat.dtype == like.dtype:
        return flat
    if not _fits(flat, like.dtype):  # a view misaligned for the words: copy it
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(like.dtype)


def _contiguous_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype` and contiguous, in one pass (a permuted copy and a cast together)."""
    if x.is_contiguous():
        return x.to(dtype)
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)


def _quantize(x: torch.Tensor, stored: torch.dtype) -> torch.Tensor:
    """Scaled float values (|x| <= qmax) to the 8-bit dtype, rounding to nearest; fp8
    values under its smallest normal number become zero (see the module's notes)."""
    qmax = QMAX[stored]
    if stored == torch.int8:
        return x.round_().clamp_(-qmax, qmax).to(torch.int8)
    # hardshrink: zero where |x| <= lambd, in one op (the flush runs every layer, every step)
    x = torch.nn.functional.hardshrink(x.clamp_(-qmax, qmax), _FP8_FLUSH)
    return x.to(stored)


def lift_for(exponent: int) -> float:
    """The factor `2**(-exponent / 2)` that values read with `exponent` are carried by
    twice: once on the other operand of a matmul, once on its result. Splitting the
    power in two keeps every product and partial sum well inside the normal range."""
    assert exponent % 2 == 0, "a read exponent splits into two equal halves"
    return 2.0 ** (-exponent // 2)


def _scale(values: torch.Tensor, scale: torch.Tensor, exponent: int) -> torch.Tensor:
    """[n, block_size, heads, head_dim] 8-bit values read with `exponent`, times their
    [n, heads] scales: the true values, in place."""
    lift = lift_for(exponent)
    values.mul_((scale * lift).to(values.dtype)[:, None, :, None])
    return values if lift == 1.0 else values.mul_(lift)

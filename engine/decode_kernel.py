"""A decode step as one compiled CPU kernel (numba), in bfloat16.

Lifecycle: `engine.fused_decode.FusedDecoder` asks `decode_step(heads, kv_heads,
head_dim)` (or, over an 8-bit cache, `decode_step_8bit(..., kind)`) for the step
compiled for its model's dimensions (numba compiles it at the
decoder's warm-up and caches it on disk, so later processes load it) and calls it once
per fused step; nothing here holds state.

Why: a decode step reads every weight once and does little else, so its floor is the
weights' bytes over memory bandwidth. Through torch a step costs well above that floor:
oneDNN's one-row products read the weights slower than memory delivers them, and each
of the step's other small ops (norms, rotary, attention, residuals, over every layer)
pays its own dispatch, which at a few rows is a large share of the step. Here nothing
is dispatched per op, and the products (`engine.weight_tiles`) stream each weight from
memory once per step for every row of it, up to `engine.fused_decode.MAX_ROWS` rows.
Measurements (the floor, the torch step, the fused step by batch size): docs/engine.md
"Kernels".

Numerics: weights and the embeddings are bfloat16, and so are the activations
entering each projection (rounded once per product, as torch's bf16 path holds them);
everything else is float32 (the products' sums, the residual stream, norms, rotary,
attention's scores and sums), and only the K/V stored into the cache are rounded: to
bfloat16 (to nearest even, as torch's cast), or into an 8-bit cache's codes and
scales by the cache's own write (`engine.kv_quant_kernel.write_layer`). The torch path rounds to
bfloat16 after every op, so the two differ in the last bits; this one is the nearer to
the float32 model (`tests/unit/engine/test_fused_decode.py`).

The float math is compiled with reassociation (so LLVM splits each dot product into
vector lanes) but not with "no NaNs/infinities", which would let it drop the checks
an overflowed activation needs to stay visible.
"""

from __future__ import annotations

import functools
import hashlib
import math
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import numba
import numpy as np

from engine import bf16_bits, kv_quant_kernel, lora_kernel, weight_tiles
from engine.bf16_bits import bits_as_f32, to_bf16, widen
from engine.kv_quant_kernel import INT8, write_layer
from engine.lora_kernel import add_lora
from engine.weight_tiles import matmul

_F32 = np.float32


def source_digest(*modules: ModuleType) -> int:
    """A 63-bit digest of these modules' source files."""
    text = b"".join(Path(m.__file__ or "").read_bytes() for m in modules)
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


#: The compiled entry points (`decode_step`'s step, `decode_attention`'s attend) take in
#: code from these modules, but numba's disk cache checks only the stamp of the file
#: that defines the function it caches: the modules' digest rides in each entry point's
#: closure, which the cache's key includes, so editing them rebuilds the cached entry
#: point instead of loading a stale one. The helpers between (`_attend`, `_rms_norm`,
#: `_silu_mul`, `weight_tiles.matmul`) are not cached on their own for the same reason:
#: they compile into the entry point that calls them, and are cached only inside it.
_INLINED_DIGEST = source_digest(bf16_bits, kv_quant_kernel, lora_kernel, weight_tiles)
#: LLVM fast-math flags: reassociate sums (vector lanes) and fuse multiply-adds.
FAST_MATH = {"reassoc", "contract", "arcp", "nsz"}


_LOG2E = _F32(1.4426950408889634)
_LN2_HI = _F32(0.693359375)  # ln 2 split so that n * _LN2_HI is exact for |n| <= 127
_LN2_LO = _F32(-2.1219444005469057e-4)
# 1/k!: e**r's Taylor series to r**7, within 4e-9 for |r| <= ln(2)/2.
_C7, _C6, _C5 = _F32(1 / 5040), _F32(1 / 720), _F32(1 / 120)
_C4, _C3, _C2 = _F32(1 / 24), _F32(1 / 6), _F32(0.5)
_FP8_LIFT = _F32(2.0**120)  # see codes_as_f32
#: numba raises ZeroDivisionError from a float division unless told numpy's rules (inf
#: or NaN), and that check per element keeps LLVM from vectorizing a loop that divides.
#: No division in the step can be by zero (a softmax's total holds its top weight 1, a
#: norm adds eps, a SiLU divides by 1 + e**-g), so the functions that divide use those.
NUMPY_ERRORS: Final = "numpy"


@numba.njit(cache=True, nogil=True, inline="always")
def exp_f32(x: np.float32) -> np.float32:
    """e**x in float32 as arithmetic that LLVM can vectorize (libm's expf is a call per
    element, which it cannot): e**x = 2**n * e**r with n = round(x / ln 2) and |r| <=
    ln(2)/2, e**r by its Taylor series, 2**n by placing n in the exponent's bits, so the
    loops that call it (SiLU, softmax) vectorize.

    Within 1.5 units in the last place of exact (`test_fused_decode.py` holds it; what
    it measured, and libm's expf beside it: docs/engine.md "Kernels"). x is clamped to
    [-87, 88] first, so that 2**n stays a normal float: e**x below e**-87 (1.6e-38)
    comes back as 1.6e-38 and above e**88 as 1.7e38 (finite), which moves no softmax
    weight or SiLU by a representable amount.
    NaN stays NaN. Written without branches (selects only), which LLVM vectorizes.
    Inlined into `_attend`, which is compiled with reassociation, LLVM may fold the
    split reduction back into one product: a few ulp more there, nothing a softmax
    weight notices (the test holds the copy compiled without it)."""
    c = x if x > _F32(-87.0) else _F32(-87.0)
    c = c if c < _F32(88.0) else _F32(88.0)
    n = np.floor(c * _LOG2E + _F32(0.5))
    r = (c - n * _LN2_HI) - n * _LN2_LO
    p = ((((_C7 * r + _C6) * r + _C5) * r + _C4) * r + _C3) * r + _C2
    p = (p * r + _F32(1.0)) * r + _F32(1.0)
    e = p * bits_as_f32(np.uint32(np.int32(n) + np.int32(127)) << np.uint32(23))
    return e if x == x else x


@numba.njit(nogil=True, error_model=NUMPY_ERRORS)  # uncached: see _INLINED_DIGEST
def _silu_mul(gate_up: np.ndarray, out: np.ndarray) -> None:
    """out[r] = silu(gate) * up for each row's halves [gate | up] of `gate_up`. Through
    slices: a computed index (`gate_up[r, inter + j]`) that numba cannot prove
    non-negative keeps its wraparound check, which LLVM does not vectorize."""
    inter = out.shape[1]
    for r in range(gate_up.shape[0]):
        gate, up, row = gate_up[r, :inter], gate_up[r, inter:], out[r]
        for j in range(inter):
            g = gate[j]
            row[j] = g / (_F32(1.0) + exp_f32(-g)) * up[j]


@numba.njit(nogil=True, fastmath=FAST_MATH, error_model=NUMPY_ERRORS)  # uncached, as _silu_mul
def _rms_norm(x: np.ndarray, gain: np.ndarray, eps: float, out: np.ndarray) -> None:
    """out[r] = x[r] / rms(x[r]) * gain, in float32 (`gain` bfloat16 bits)."""
    n = x.shape[1]
    for r in range(x.shape[0]):
        sq = _F32(0.0)
        for j in range(n):
            sq += x[r, j] * x[r, j]
        inv = _F32(1.0) / math.sqrt(sq / n + eps)
        for j in range(n):
            out[r, j] = x[r, j] * inv * widen(gain[j])


@numba.njit(nogil=True, fastmath=FAST_MATH, error_model=NUMPY_ERRORS)  # uncached, as _silu_mul
def _attend(
    q: np.ndarray, pool: np.ndarray, base: np.ndarray, k_off: int, v_off: int, seq_len: int,
    out: np.ndarray, heads: int, kv_heads: int, hd: int,
) -> None:  # fmt: skip
    """Attention of `q` ([heads * hd]) over `seq_len` cached tokens, into `out`: token
    p's K row ([kv_heads * hd]) starts at element `base[p] + k_off` of the pool and its
    V row at `base[p] + v_off`.

    One pass over the cached K rows, then one over the V rows: each row is converted to
    float32 once and used by every query head (a query head reads its group's KV head).
    A pass per KV head instead reads the layer's cached context once per KV head, and at
    long contexts that context no longer stays in L2 between passes.

    Cached rows are read through slices, never as `pool[base + e]`: numba wraps a
    negative index around, and with an offset it cannot prove non-negative, that check
    stays in the loop and keeps LLVM from vectorizing the row's conversion (what that
    cost: docs/engine.md "Kernels")."""
    group = heads // kv_heads
    width = kv_heads * hd
    scale = _F32(1.0 / math.sqrt(hd))
    scores = np.empty((heads, seq_len), dtype=np.float32)
    row = np.empty(width, dtype=np.float32)
    for p in range(seq_len):
        k = pool[base[p] + k_off : base[p] + k_off + width]
        for e in range(width):
            row[e] = widen(k[e])
        for h in range(heads):
            qh, kh = h * hd, (h // group) * hd
            s = _F32(0.0)
            for d in range(hd):
                s += q[qh + d] * row[kh + d]
            scores[h, p] = s * scale
    _softmax(scores)
    out[: heads * hd] = 0.0
    for p in range(seq_len):
        v = pool[base[p] + v_off : base[p] + v_off + width]
        for e in range(width):
            row[e] = widen(v[e])
        for h in range(heads):
            qh, vh = h * hd, (h // group) * hd
            w = scores[h, p]
            for d in range(hd):
                out[qh + d] += w * row[vh + d]


@numba.njit(nogil=True, fastmath=FAST_MATH, error_model=NUMPY_ERRORS)  # uncached, as _silu_mul
def _softmax(scores: np.ndarray) -> None:
    """Each row of `scores` ([heads, positions] float32) softmaxed in place."""
    for h in range(scores.shape[0]):
        head = scores[h]
        top = head[0]
        for p in range(1, head.shape[0]):
            top = max(top, head[p])
        total = _F32(0.0)
        for p in range(head.shape[0]):
            weight = exp_f32(head[p] - top)
            head[p] = weight
            total += weight
        for p in range(head.shape[0]):
            head[p] /= total


@numba.njit(nogil=True, inline="always")
def codes_as_f32(codes: np.ndarray, out: np.ndarray, kind: int) -> None:
    """An 8-bit cache's stored bytes (an int8 view) as float32 values, before their
    scale, in arithmetic LLVM vectorizes (a table lookup per element it does not).

    int8: a conversion. fp8 e4m3fn: its sign, exponent and mantissa bits moved into a
    bfloat16's (sign to bit 15, the rest to bits 10-4, as `engine.kv_cache` reads
    them) make a number 2**-120 times the stored one, normal or subnormal alike, so
    widening that and multiplying by 2**120 is exact. The NaN codes read as +-480, as
    the torch read and the write's table (`kv_quant_kernel.decode_table`) read them."""
    if kind == INT8:
        for e in range(codes.shape[0]):
            out[e] = _F32(codes[e])
    else:
        for e in range(codes.shape[0]):
            moved = (np.int32(codes[e]) << np.int32(4)) & np.int32(0x87F0)
            out[e] = bits_as_f32(np.uint32(moved) << np.uint32(16)) * _FP8_LIFT


@numba.njit(nogil=True, fastmath=FAST_MATH, error_model=NUMPY_ERRORS)  # uncached, as _silu_mul
def _attend_8bit(
    q: np.ndarray, pool: np.ndarray, scales: np.ndarray, base: np.ndarray, blocks: np.ndarray,
    offs: tuple[int, int, int, int], seq_len: int, out: np.ndarray, heads: int, kv_heads: int,
    hd: int, bs: int, kind: int,
) -> None:  # fmt: skip
    """`_attend` over an 8-bit cache: token p's K row starts at byte `base[p] + k_off`
    of `pool` (the pool's bytes, flat) and its V row at `+ v_off`; each (block, K/V,
    KV head) has one float32 scale, at `k_at` (K) or `v_at` (V) plus the head within
    the block's row of `scales` (`blocks` the sequence's block ids). The scales apply
    to a head's score and to its softmax weight, not to each element (head_dim times
    fewer products)."""
    k_off, v_off, k_at, v_at = offs
    group = heads // kv_heads
    width = kv_heads * hd
    scale = _F32(1.0 / math.sqrt(hd))
    scores = np.empty((heads, seq_len), dtype=np.float32)
    row = np.empty(width, dtype=np.float32)
    for p in range(seq_len):
        codes_as_f32(pool[base[p] + k_off : base[p] + k_off + width], row, kind)
        block_scales = scales[blocks[p // bs]]
        for h in range(heads):
            g = h // group
            qh, kh = h * hd, g * hd
            s = _F32(0.0)
            for d in range(hd):
                s += q[qh + d] * row[kh + d]
            scores[h, p] = s * scale * block_scales[k_at + g]
    _softmax(scores)
    out[: heads * hd] = 0.0
    for p in range(seq_len):
        codes_as_f32(pool[base[p] + v_off : base[p] + v_off + width], row, kind)
        block_scales = scales[blocks[p // bs]]
        for h in range(heads):
            g = h // group
            qh, vh = h * hd, g * hd
            w = scores[h, p] * block_scales[v_at + g]
            for d in range(hd):
                out[qh + d] += w * row[vh + d]


@numba.njit(nogil=True)  # uncached, as _silu_mul
def _layer_input(
    x: np.ndarray, layer: int, weights: tuple[np.ndarray, ...], eps: float, h: np.ndarray,
    qkv: np.ndarray, lora: tuple[Any, np.ndarray],
) -> None:  # fmt: skip
    """`layer`'s input norm of the residual stream `x` and its QKV projection into `qkv`,
    with the rows' adapters' deltas (`lora`: the operands and each row's slot,
    `engine.fused_lora`)."""
    _rms_norm(x, weights[8][layer], eps, h)
    matmul(weights[0][layer], h, qkv)
    _add_bias(qkv, weights[1][layer])
    add_lora(h, qkv, lora[0], lora[1], layer, 0)


@numba.njit(nogil=True)  # uncached, as _silu_mul
def _layer_output(
    x: np.ndarray, layer: int, weights: tuple[np.ndarray, ...], eps: float, attn: np.ndarray,
    h: np.ndarray, proj: np.ndarray, gate_up: np.ndarray, act: np.ndarray,
    lora: tuple[Any, np.ndarray],
) -> None:  # fmt: skip
    """The rest of `layer` after attention (`attn`): output projection and residual,
    post-attention norm, MLP and residual, into `x`; each projection with the rows'
    adapters' deltas, as `_layer_input`."""
    matmul(weights[2][layer], attn, proj)
    _add_bias(proj, weights[3][layer])
    add_lora(attn, proj, lora[0], lora[1], layer, 1)
    x += proj
    _rms_norm(x, weights[9][layer], eps, h)
    matmul(weights[4][layer], h, gate_up)
    _add_bias(gate_up, weights[5][layer])
    add_lora(h, gate_up, lora[0], lora[1], layer, 2)
    _silu_mul(gate_up, act)
    matmul(weights[6][layer], act, proj)
    _add_bias(proj, weights[7][layer])
    add_lora(act, proj, lora[0], lora[1], layer, 3)
    x += proj


@numba.njit(nogil=True)  # uncached, as _silu_mul
def _scratch(
    rows: int, weights: tuple[np.ndarray, ...], heads: int, hd: int
) -> tuple[np.ndarray, ...]:
    """A step's activations: h, qkv, attn, proj, gate_up, act (float32, [rows, ...])."""
    hidden = weights[3].shape[1]
    inter = weights[5].shape[1] // 2  # the packed weights' tiles are padded; biases not
    return (
        np.empty((rows, hidden), dtype=np.float32),
        np.empty((rows, weights[1].shape[1]), dtype=np.float32),
        np.empty((rows, heads * hd), dtype=np.float32),
        np.empty((rows, hidden), dtype=np.float32),
        np.empty((rows, 2 * inter), dtype=np.float32),
        np.empty((rows, inter), dtype=np.float32),
    )


@numba.njit(cache=True, nogil=True)
def _rotate(vec: np.ndarray, cos: np.ndarray, sin: np.ndarray, heads: int, hd: int) -> None:
    """Rotary embedding in place on the first `heads` heads of `vec` (HF's rotate_half:
    the first half of a head pairs with the second)."""
    half = hd // 2
    for h in range(heads):
        base = h * hd
        for i in range(half):
            a, b = vec[base + i], vec[base + half + i]
            vec[base + i] = a * cos[i] - b * sin[i]
            vec[base + half + i] = b * cos[half + i] + a * sin[half + i]


@numba.njit(cache=True, nogil=True)
def _add_bias(y: np.ndarray, bias: np.ndarray) -> None:
    for r in range(y.shape[0]):
        for j in range(y.shape[1]):
            y[r, j] += bias[j]


def check_heads(heads: int, kv_heads: int, hd: int) -> None:
    """The attention dimensions the kernels divide by (compiled under numpy's error
    model, an integer division by zero would not raise there)."""
    if kv_heads <= 0 or hd <= 0 or heads % kv_heads:
        raise ValueError(f"heads {heads} must be a positive multiple of kv_heads {kv_heads}")


@functools.cache
def decode_step(heads: int, kv_heads: int, hd: int) -> Any:
    """The compiled step for a model of these attention dimensions (one per process and
    shape). The step holds them as constants, which LLVM carries into the attention and
    rotary loops it inlines (as run-time values they leave those loops generic, and
    long-context steps slower: docs/engine.md "Kernels"). It closes over these three
    integers and `_INLINED_DIGEST` only, which numba's cache key includes, so its disk
    cache serves later processes.

    `step(x, positions, tables, weights, cos, sin, pool, block_size, block_elems, eps,
    lora, logits)` runs every layer of one decode step, then the final norm and the LM
    head.
    `x` [rows, hidden] float32 holds the tokens' embeddings and is the residual stream;
    `positions` [rows] each token's position (its sequence has position + 1 tokens with
    it); `tables` [rows, blocks] their block ids, covering every position. Several rows
    may be one sequence's consecutive positions (a verification of drafts), in
    position order: within each layer a row writes its K/V before it attends, and the
    rows run in order, so each attends over those of the rows before it; `weights` the
    `FusedDecoder` tuple (projections packed by `engine.weight_tiles.pack`); `pool` the
    KV pool as uint16, `block_elems` elements a block; `lora` the rows' adapters (the
    operand list and each row's slot, -1 for none: `engine.fused_lora`); `logits`
    [rows, vocab] receives the result."""
    check_heads(heads, kv_heads, hd)
    digest = _INLINED_DIGEST

    @numba.njit(cache=True, nogil=True)
    def step(
        x: np.ndarray, positions: np.ndarray, tables: np.ndarray,
        weights: tuple[np.ndarray, ...], cos: np.ndarray, sin: np.ndarray, pool: np.ndarray,
        bs: int, block_elems: int, eps: float, lora: tuple[Any, np.ndarray], logits: np.ndarray,
    ) -> None:  # fmt: skip
        digest  # noqa: B018 -- read so that the closure, which the cache keys on, holds it
        q_size, kv_size = heads * hd, kv_heads * hd
        h, qkv, attn, proj, gate_up, act = _scratch(x.shape[0], weights, heads, hd)
        k_rows = row_bases(tables, positions + 1, bs, block_elems, kv_size)
        for layer in range(weights[0].shape[0]):
            layer_k = 2 * layer * bs * kv_size  # the layer's K rows within a block
            layer_v = layer_k + bs * kv_size
            _layer_input(x, layer, weights, eps, h, qkv, lora)
            for r in range(x.shape[0]):
                pos = positions[r]
                _rotate(qkv[r], cos[pos], sin[pos], heads + kv_heads, hd)
                # The new token's K and V into the cache, then attention over all of it.
                at = k_rows[r, pos]
                k_out = pool[at + layer_k : at + layer_k + kv_size]
                v_out = pool[at + layer_v : at + layer_v + kv_size]
                for j in range(kv_size):
                    k_out[j] = to_bf16(qkv[r, q_size + j])
                    v_out[j] = to_bf16(qkv[r, q_size + kv_size + j])
                _attend(qkv[r], pool, k_rows[r], layer_k, layer_v, pos + 1, attn[r],
                        heads, kv_heads, hd)  # fmt: skip
            _layer_output(x, layer, weights, eps, attn, h, proj, gate_up, act, lora)
        _rms_norm(x, weights[10], eps, h)
        matmul(weights[11], h, logits)

    return step


@functools.cache
def decode_step_8bit(heads: int, kv_heads: int, hd: int, kind: int) -> Any:
    """`decode_step` over an 8-bit KV cache of `kind` (`kv_quant_kernel.INT8` or
    `FP8`), compiled and cached the same way.

    `step(x, positions, tables, weights, cos, sin, pool, scales, bs, eps, quant,
    lora, logits)`: as `decode_step`'s, but `pool` is the pool's bytes as int8 [blocks,
    bytes_per_block] and `scales` the same bytes as float32 [blocks, bytes_per_block /
    4]; `quant` is (table, qmax, headroom, min_scale, flush_bits, scale_base): the
    write's constants and where a block's scales start (`kv_quant_kernel.QuantWriter`).
    Each row's new K and V go through the cache's own compiled write
    (`kv_quant_kernel.write_layer`: the same scales, growth and rounding as a torch
    step's), one token at a time in row order, before the row attends; the caller
    zeroes a block a row starts (offset 0), as `KvCache.plan_write` does."""
    check_heads(heads, kv_heads, hd)
    digest = _INLINED_DIGEST

    @numba.njit(cache=True, nogil=True)
    def step(
        x: np.ndarray, positions: np.ndarray, tables: np.ndarray,
        weights: tuple[np.ndarray, ...], cos: np.ndarray, sin: np.ndarray, pool: np.ndarray,
        scales: np.ndarray, bs: int, eps: float, quant: tuple[Any, ...],
        lora: tuple[Any, np.ndarray], logits: np.ndarray,
    ) -> None:  # fmt: skip
        digest  # noqa: B018 -- read so that the closure, which the cache keys on, holds it
        table, qmax, headroom, min_scale, flush_bits, scale_base = quant
        q_size, kv_size = heads * hd, kv_heads * hd
        h, qkv, attn, proj, gate_up, act = _scratch(x.shape[0], weights, heads, hd)
        flat = pool.reshape(-1)
        k_rows = row_bases(tables, positions + 1, bs, pool.shape[1], kv_size)
        new = np.empty((2, 1, kv_heads, hd), dtype=np.float32)
        block, offset = np.empty(1, dtype=np.int64), np.empty(1, dtype=np.int64)
        for layer in range(weights[0].shape[0]):
            k_at = scale_base + 2 * layer * kv_heads  # the layer's K scales within a block
            offs = (2 * layer * bs * kv_size, (2 * layer + 1) * bs * kv_size, k_at, k_at + kv_heads)
            _layer_input(x, layer, weights, eps, h, qkv, lora)
            for r in range(x.shape[0]):
                pos = positions[r]
                _rotate(qkv[r], cos[pos], sin[pos], heads + kv_heads, hd)
                for j in range(kv_size):
                    new[0, 0, j // hd, j % hd] = qkv[r, q_size + j]
                    new[1, 0, j // hd, j % hd] = qkv[r, q_size + kv_size + j]
                block[0], offset[0] = tables[r, pos // bs], pos % bs
                write_layer(pool, scales, new, block, offset, layer, bs, scale_base, kind,
                            table, qmax, headroom, min_scale, flush_bits)  # fmt: skip
                _attend_8bit(qkv[r], flat, scales, k_rows[r], tables[r], offs, pos + 1, attn[r],
                             heads, kv_heads, hd, bs, kind)  # fmt: skip
            _layer_output(x, layer, weights, eps, attn, h, proj, gate_up, act, lora)
        _rms_norm(x, weights[10], eps, h)
        matmul(weights[11], h, logits)

    return step


@functools.cache
def decode_attention(heads: int, kv_heads: int, hd: int) -> Any:
    """Decode attention alone, compiled for these dimensions (as `decode_step`), for the
    torch forward's larger decode steps (`engine.attention.TorchAttention`):
    `attend(q, pool, bases, seq_lens, k_off, v_off, out)` attends each row of `q`
    ([rows, heads * hd] float32) over its sequence's `seq_lens[r]` cached tokens, token
    p's K row at element `bases[r, p] + k_off` of `pool` and its V row at `+ v_off`."""
    check_heads(heads, kv_heads, hd)
    digest = _INLINED_DIGEST

    @numba.njit(cache=True, nogil=True)
    def attend(
        q: np.ndarray, pool: np.ndarray, bases: np.ndarray, seq_lens: np.ndarray,
        k_off: int, v_off: int, out: np.ndarray,
    ) -> None:  # fmt: skip
        digest  # noqa: B018 -- read so that the closure, which the cache keys on, holds it
        for r in range(q.shape[0]):
            _attend(q[r], pool, bases[r], k_off, v_off, seq_lens[r], out[r], heads, kv_heads, hd)

    return attend


@numba.njit(cache=True, nogil=True)
def row_bases(
    tables: np.ndarray, seq_lens: np.ndarray, bs: int, block_stride: int, row_stride: int
) -> np.ndarray:
    """[rows, longest] element offsets of each sequence's cached tokens within a layer's
    K rows: block `tables[r, p // bs]`, slot `p % bs` (a layer adds its own offset)."""
    out = np.zeros((tables.shape[0], max(seq_lens.max(), 1)), dtype=np.int64)
    for r in range(tables.shape[0]):
        for p in range(seq_lens[r]):
            out[r, p] = np.int64(tables[r, p // bs]) * block_stride + (p % bs) * row_stride
    return out

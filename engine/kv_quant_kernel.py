"""The 8-bit KV cache's write as one compiled CPU kernel per layer (numba).

Lifecycle: `KvCache` builds one `QuantWriter` for an 8-bit pool on CPU, with numpy
views of the pool's bytes and scales that live as long as the pool, and writes no
tokens through it once, which compiles the kernel at engine start (numba caches it on
disk, so later processes load it). Each layer of each step then calls
`write(layer, x, blocks, offsets)`.

Why a kernel: in torch the write is about 35 small ops per layer (the largest of each
head, the scale that must grow, re-expressing a grown block's earlier tokens, rounding,
the copies), each paying its own dispatch. At decode batch sizes that dispatch cost
several times an unquantized cache's write and kept an 8-bit cache's throughput under
the share of the unquantized cache's that issue 21 asks for (measurements:
docs/engine.md "8-bit KV cache"). One kernel call does the same work in a
single pass over the step's tokens, and re-expresses only the (block, K/V, head) slices
whose scale grew, not whole blocks. Why numba: it compiles plain Python loops to machine
code at run time from a wheel (llvmlite), with no C compiler on the host and no build
step in the install; torch's own compiler needs a C++ toolchain.

What it computes is `KvCache._write_8bit`'s result byte for byte (the tests compare the
two) for finite K and V and blocks this version wrote: the same float32 arithmetic,
round-half-even, int8's clamp to +-127, and fp8 e4m3's rounding, saturation at 448 and
flush of values under its smallest normal to zero. The two differ only where the torch
write re-encodes slices whose scale did not grow (it re-expresses whole blocks): an
older peer's fp8 subnormals and NaN codes stay as they are here. Block ids are not
checked here (numba has no bounds checks): `KvCache.plan_write` checks them once a
step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

INT8, FP8 = 0, 1
_F32 = np.float32
_ROUNDER = _F32(1.5 * 2**23)


def _f32_bits(value: float) -> int:
    return int(np.array([value], dtype=np.float32).view(np.int32)[0])


#: float32 bit patterns the fp8 encoding compares magnitudes against (a positive
#: float's bits order as its value does).
_BITS_448 = _f32_bits(448.0)
_BITS_MIN_NORMAL = _f32_bits(2.0**-6)
#: e4m3's exponent bias is 7, float32's 127: a code is float32's top 12 bits (after
#: rounding off the low 20) less this.
_FP8_REBIAS = (127 - 7) << 3


def decode_table(kind: int) -> np.ndarray:
    """float32 [256]: the value of each stored byte (as unsigned), for re-expressing.
    e4m3fn's NaN codes read as +-480, as `kv_cache._as_dtype` reads them."""
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.int8)
    if kind == INT8:
        return codes.float().numpy()
    values = codes.view(torch.float8_e4m3fn).float()
    nan = values.isnan()
    values[nan] = torch.where(codes[nan] < 0, -480.0, 480.0)
    return values.numpy()


@numba.njit(cache=True, nogil=True, inline="always")
def encode_into(dst: np.ndarray, base: int, src: np.ndarray, kind: int, flush_bits: int) -> None:
    """Store float32 `src` (already divided by its scale) as bytes at `dst[base:]`.

    int8: round half to even, clamped to +-127 (a scaled value exceeds 127 only by
    rounding). fp8 e4m3fn: saturated at +-448,
    round half to even on the bits (adding 0x7FFFF plus the kept lowest bit carries
    exactly where rounding to nearest even does, into the exponent included), magnitudes
    at most the flush as +0 (no subnormals stored) and those just above it as the
    smallest normal, which they round to."""
    n = src.shape[0]
    if kind == INT8:
        for i in range(n):
            # Adding and taking away 1.5 * 2**23 rounds a float32 to an integer, half to
            # even (values here are within +-2**22); unlike rint, it vectorizes.
            whole = (src[i] + _ROUNDER) - _ROUNDER
            dst[base + i] = np.int8(min(max(whole, _F32(-127.0)), _F32(127.0)))
        return
    bits = src.view(np.int32)
    for i in range(n):
        mag = min(bits[i] & 0x7FFFFFFF, _BITS_448)
        if mag <= flush_bits:
            code = 0
        elif mag < _BITS_MIN_NORMAL:
            code = 0x08
        else:
            code = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - _FP8_REBIAS
        if bits[i] < 0 and code != 0:
            code |= 0x80
        dst[base + i] = np.int8(code - 256 if code > 127 else code)


@numba.njit(cache=True, nogil=True)  # touches only arrays: other threads run meanwhile
def write_layer(
    pool: np.ndarray,  # int8 [blocks, bytes_per_block]: the pool's bytes
    scales: np.ndarray,  # float32 [blocks, bytes_per_block / 4]: the same bytes
    x: np.ndarray,  # float32 [2, tokens, heads, dim]: this step's K and V of `layer`
    blocks: np.ndarray,  # int64 [tokens]
    offsets: np.ndarray,  # int64 [tokens]
    layer: int,
    block_size: int,
    scale_base: int,  # index in `scales` of the block's first scale
    kind: int,
    table: np.ndarray,  # float32 [256] (`decode_table`)
    qmax: np.float32,
    headroom: np.float32,
    min_scale: np.float32,
    flush_bits: int,
) -> None:
    tokens, heads, dim = x.shape[1], x.shape[2], x.shape[3]
    row = heads * dim
    scratch = np.empty(dim, dtype=np.float32)
    start = 0
    while start < tokens:  # one run of consecutive tokens in one block at a time
        block, end = blocks[start], start + 1
        while end < tokens and blocks[end] == block:
            end += 1
        room = _F32(1.0) if offsets[start:end].max() == block_size - 1 else headroom
        data, scale = pool[block], scales[block]
        for kv in range(2):
            plane = (layer * 2 + kv) * block_size * row  # this layer's K or V rows
            for h in range(heads):
                needed = _F32(0.0)
                for t in range(start, end):
                    for d in range(dim):
                        needed = max(needed, abs(x[kv, t, h, d]))
                needed = needed / qmax
                at = scale_base + (layer * 2 + kv) * heads + h
                old = scale[at]
                new = max(old, min_scale)
                if needed > old:
                    new = max(needed * room, min_scale)
                    if old > 0:  # re-express the slice's earlier tokens in the new scale
                        ratio = old / new
                        for o in range(block_size):
                            first = plane + o * row + h * dim
                            if kind == INT8:  # a conversion, which vectorizes
                                for d in range(dim):
                                    scratch[d] = _F32(data[first + d]) * ratio
                            else:
                                for d in range(dim):
                                    scratch[d] = table[data[first + d] & 0xFF] * ratio
                            encode_into(data, first, scratch, kind, flush_bits)
                scale[at] = new
                for t in range(start, end):
                    for d in range(dim):
                        scratch[d] = x[kv, t, h, d] / new
                    encode_into(data, plane + offsets[t] * row + h * dim, scratch, kind, flush_bits)
        start = end


@dataclass
class QuantWriter:
    """The compiled write for one 8-bit pool on CPU (see the module's notes).

    `pool` and `scales` are numpy views of the pool's bytes (int8 and float32, both
    [blocks, ...] and C-contiguous, so the kernel's inner loops run over contiguous
    memory); `scale_base` is where a block's scales start, in float32s."""

    pool: np.ndarray
    scales: np.ndarray
    block_size: int
    scale_base: int
    kind: int
    qmax: float
    headroom: float
    min_scale: float
    flush: float

    def __post_init__(self) -> None:
        self._table = decode_table(self.kind)
        self._flush_bits = _f32_bits(self.flush)
        nothing = torch.empty(0, dtype=torch.long)
        self.write(0, torch.empty(2, 0, 1, 1), nothing, nothing)  # compiles (or loads) it

    @property
    def constants(self) -> tuple[np.ndarray, np.float32, np.float32, np.float32, int, int]:
        """What `write_layer` takes besides the data, for a compiled caller
        (`engine.decode_kernel.decode_step_8bit`): the decode table, qmax, headroom,
        min_scale, the flush's bits and `scale_base`."""
        return (
            self._table, _F32(self.qmax), _F32(self.headroom), _F32(self.min_scale),
            self._flush_bits, self.scale_base,
        )  # fmt: skip

    def write(
        self, layer: int, x: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
    ) -> None:
        """Quantize [2 (K, V), T, heads, dim] float32 `x` (contiguous) into token t's
        `blocks[t]` at `offsets[t]` of `layer`, growing and re-expressing scales as
        needed. Tokens of one block must be consecutive (a step's always are)."""
        write_layer(
            self.pool, self.scales, x.numpy(), blocks.numpy(), offsets.numpy(), layer,
            self.block_size, self.scale_base, self.kind, self._table, _F32(self.qmax),
            _F32(self.headroom), _F32(self.min_scale), self._flush_bits,
        )  # fmt: skip

"""Weights packed in tiles of output rows, and the compiled product that streams them for
a few input rows at a time (numba, with the inner loop written in LLVM IR): bfloat16
weights for the fused decode, float32 weights for the tiled linear kernel.

Lifecycle: `engine.fused_decode.FusedDecoder` packs each projection once at load
(`pack`, stacked over layers) and keeps the packed copy; the fused decode step
(`engine.decode_kernel`) calls `matmul(tiles, x, out)` for every projection of every
step. `engine.linear_kernel.TiledLinear` does the same through `pack_f32` and
`matmul_f32` for float32 weights. Nothing here holds state.

Batch invariance, by construction: each output of each row is one float32 accumulator
that sums its products in input order, one pair (bfloat16) or one feature (float32) per
step, with no sum across vector lanes and no split of the input features. How many rows
share a pass, a call or a thread changes which loop runs and which tiles a thread takes,
never the operations or their order for one output, so a row's bits do not depend on
the other rows (`tests/unit/engine/test_weight_tiles.py` holds it).

Layout: a weight [n_out, n_in] becomes [tiles, pairs, 2 * TILE] bfloat16 bits, pairs =
ceil(n_in / 2): tile t holds output rows t*TILE .. t*TILE + TILE - 1, and each 128 bytes
of it one pair of input features for those outputs, each output's two weights side by
side (zeros pad the last tile and an odd last feature). That is the operand of AVX-512
BF16's dot-product instruction (`vdpbf16ps`: per 32-bit lane, acc += a0*b0 + a1*b1 of
bfloat16 pairs, summed in float32), and a tile is then a product of TILE outputs by up
to `PASS_ROWS` input rows with every accumulator in a vector register: per pair of
features, two loads of weights, one broadcast of each row's pair and two dot products
per row. Nothing is summed across vector lanes. Rows are rounded to bfloat16 once per
call, as the torch path's activations already are; products and sums are float32.
`matmul` runs every pass of the call's rows over a tile before it reads the next tile,
so each weight leaves memory once per call whatever the number of rows.

Where the CPU lacks AVX-512 BF16 (llvmlite's host features say so) the same loop widens
each weight pair and each row's pair to float32 and runs fused multiply-adds: the same
numbers up to the order of the sum (and `vdpbf16ps` flushing subnormal inputs and
outputs to zero), with two multiply-adds and the widening where `vdpbf16ps` is one
instruction.

float32 weights use the same geometry: tile t holds [n_in, TILE] float32, so each
input feature's 32 weights fill the same 128 bytes a bfloat16 pair's do, and one
multiply-add per vector replaces the pair's two. `pack_f32` returns them as the same
uint16 array shape ([tiles, n_in, 2 * TILE]), so one intrinsic serves both.

Why not numba's own vectorizer: written as loops over a row-major weight, LLVM
vectorizes each output's dot product along the input features, which needs a lane-wise
sum per output and row and converts each weight once per row; from a few rows on that
was slower than oneDNN's packed products. numba cannot keep a small accumulator array
in registers, so the tile's loop is emitted as LLVM IR through
`numba.extending.intrinsic`: one loop for each row count from 1 to `PASS_ROWS`, chosen
by a switch on the count.

Why the prefetch: with its weights in cache the tile's loop is bound by arithmetic, but
streaming them from memory the hardware prefetcher does not run far enough ahead of a
loop that computes between loads, and the loop waits on memory. Each step of the loop
therefore asks for the lines `PREFETCH_BYTES` ahead (past the tile's end that is the
next tile's start, which is contiguous); the distance was chosen by measurement.

Measurements (the products against oneDNN's by row count, the prefetch distances
tried, the numba-vectorized products this replaced): docs/engine.md "Kernels".

numba's disk cache checks only the source file of the function it caches, so
`decode_kernel`, which compiles this module's code into its step, keys its cache on a
digest of this file too.
"""

from __future__ import annotations

import enum
from typing import Any

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from engine.bf16_bits import to_bf16

#: Output rows per tile: two vectors of 16 float32 lanes.
TILE = 32
LANES = 16
#: Most input rows one pass over the weights serves (more rows take more passes, of
#: equal size). At 12 the dot-product loop keeps 24 accumulators and two weight vectors
#: in the 32 vector registers (the float32 fallback four).
PASS_ROWS = 12
#: How far ahead of the loop the weights are prefetched (see the module docstring).
PREFETCH_BYTES = 16 << 10


def _host_has_bf16_dot() -> bool:
    """Whether numba compiles for this host's CPU and it has AVX-512 BF16."""
    if getattr(numba.config, "CPU_NAME", None) not in (None, "host"):
        return False  # a generic target (portable caches) may run on any CPU
    features = getattr(numba.config, "CPU_FEATURES", None)
    if features:  # numba told which features to compile for: those, not the host's
        return "+avx512bf16" in str(features).split(",")
    try:
        return bool(llvm.get_host_cpu_features().get("avx512bf16", False))
    except RuntimeError:  # llvmlite cannot read this host's features
        return False


#: Whether the tiles run `vdpbf16ps` here; else the float32 fallback.
BF16_DOT = _host_has_bf16_dot()


class Operands(enum.Enum):
    """What a tile loop multiplies, and with which instruction."""

    BF16_DOT = "bf16-dot"  # bfloat16 pairs through `vdpbf16ps`
    BF16_WIDENED = "bf16-widened"  # bfloat16 pairs widened to float32, two FMAs
    FLOAT32 = "float32"  # float32 features, one FMA


#: The bfloat16 loop this host runs.
BF16_OPERANDS = Operands.BF16_DOT if BF16_DOT else Operands.BF16_WIDENED


class _BFloat(ir.Type):
    """LLVM's `bfloat`, which llvmlite's IR builder lacks (the dot product's operand)."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


_I64 = ir.IntType(64)
_I32 = ir.IntType(32)
_BYTE_PTR = ir.IntType(8).as_pointer()
_F32X = ir.VectorType(ir.FloatType(), LANES)
_I32X = ir.VectorType(_I32, LANES)
_BF16X = ir.VectorType(_BFloat(), 2 * LANES)


def pack(bits: np.ndarray) -> np.ndarray:
    """Weights [..., n_out, n_in] (bfloat16 bits as uint16) as tiles [..., tiles, pairs,
    2 * TILE], padded with zeros."""
    *lead, n_out, n_in = bits.shape
    tiles, pairs = -(-n_out // TILE), -(-n_in // 2)
    padded = np.zeros((*lead, tiles * TILE, pairs * 2), dtype=np.uint16)
    padded[..., :n_out, :n_in] = bits
    by_pair = padded.reshape(*lead, tiles, TILE, pairs, 2).swapaxes(-2, -3)
    return np.ascontiguousarray(by_pair).reshape(*lead, tiles, pairs, 2 * TILE)


def pack_f32(weight: np.ndarray) -> np.ndarray:
    """float32 weights [n_out, n_in] as tiles [tiles, n_in, TILE] float32, padded with
    zero outputs, viewed as uint16 [tiles, n_in, 2 * TILE] (`matmul_f32`'s operand)."""
    n_out, n_in = weight.shape
    tiles = -(-n_out // TILE)
    padded = np.zeros((tiles * TILE, n_in), dtype=np.float32)
    padded[:n_out] = weight
    by_feature = padded.reshape(tiles, TILE, n_in).swapaxes(1, 2)
    return np.ascontiguousarray(by_feature).view(np.uint16)


class _TileLoop:
    """Emits one tile's product for `rows` input rows: acc[r, :TILE] = tile t times row
    r0 + r of the bfloat16 pairs, for r < rows (the caller copies acc out)."""

    def __init__(self, builder: ir.IRBuilder, rows: int, operands: Operands) -> None:
        self.b = builder
        self.rows = rows
        self.operands = operands
        module = builder.module
        if operands is Operands.BF16_DOT:
            self.dpbf16 = cgutils.get_or_insert_function(
                module,
                ir.FunctionType(_F32X, [_F32X, _BF16X, _BF16X]),
                "llvm.x86.avx512bf16.dpbf16ps.512",
            )
        else:
            self.fma = cgutils.get_or_insert_function(
                module, ir.FunctionType(_F32X, [_F32X, _F32X, _F32X]), "llvm.fma.v16f32"
            )
        prefetch_type = ir.FunctionType(ir.VoidType(), [_BYTE_PTR, _I32, _I32, _I32])
        self.prefetch = cgutils.get_or_insert_function(module, prefetch_type, "llvm.prefetch.p0")

    def emit(self, w: Any, pairs: Any, x: Any, x_stride: Any, acc: Any) -> None:
        """`w` (i32*) points at the tile's first weight pair, `x` (i32*) at row r0's
        first pair; rows are `x_stride` pairs apart. For float32 (read "feature" for
        "pair") `x` is a panel instead: feature k of the pass's row r at k * x_stride + r,
        so one pointer per step reaches every row at a constant offset (rows `x_stride`
        apart each need a register, and twelve of them spill)."""
        b = self.b
        entry = b.block
        loop, done = b.append_basic_block("tile.loop"), b.append_basic_block("tile.done")
        b.branch(loop)
        b.position_at_end(loop)
        k = b.phi(_I64)
        k.add_incoming(ir.Constant(_I64, 0), entry)
        sums = [b.phi(_F32X) for _ in range(self.rows * 2)]
        for s in sums:
            s.add_incoming(ir.Constant(_F32X, None), entry)
        line = b.gep(w, [b.mul(k, ir.Constant(_I64, TILE))])
        self._prefetch(line)
        weights = [self._load(b.gep(line, [ir.Constant(_I64, v * LANES)])) for v in (0, 1)]
        new = []
        for r in range(self.rows):
            pair = b.load(b.gep(x, [self._at(r, k, x_stride)]))
            new += self._accumulate(weights, self._splat(pair), sums[2 * r : 2 * r + 2])
        k_next = b.add(k, ir.Constant(_I64, 1))
        k.add_incoming(k_next, loop)
        for s, n in zip(sums, new, strict=True):
            s.add_incoming(n, loop)
        b.cbranch(b.icmp_signed("<", k_next, pairs), loop, done)
        b.position_at_end(done)
        for i, n in enumerate(new):
            at = b.gep(acc, [ir.Constant(_I64, i * LANES)])
            b.store(n, b.bitcast(at, _F32X.as_pointer()), align=4)

    def _at(self, r: int, k: Any, x_stride: Any) -> Any:
        """The i32 index of row r's pair (or panel feature) k."""
        b, row = self.b, ir.Constant(_I64, r)
        if self.operands is Operands.FLOAT32:
            return b.add(b.mul(k, x_stride), row)
        return b.add(b.mul(row, x_stride), k)

    def _load(self, at: Any) -> Any:
        """16 weight pairs (one per output) as 16 x i32."""
        return self.b.load(self.b.bitcast(at, _I32X.as_pointer()), align=4)

    def _splat(self, pair: Any) -> Any:
        b = self.b
        one = b.insert_element(ir.Constant(_I32X, ir.Undefined), pair, ir.Constant(_I32, 0))
        return b.shuffle_vector(one, ir.Constant(_I32X, ir.Undefined), ir.Constant(_I32X, None))

    def _accumulate(self, weights: list[Any], pair: Any, sums: list[Any]) -> list[Any]:
        """sums[v] + the dot products of weight vector v's pairs with the row's pair."""
        b = self.b
        if self.operands is Operands.BF16_DOT:
            x = b.bitcast(pair, _BF16X)
            pairs = zip(weights, sums, strict=True)
            return [b.call(self.dpbf16, [s, b.bitcast(w, _BF16X), x]) for w, s in pairs]
        if self.operands is Operands.FLOAT32:
            x = b.bitcast(pair, _F32X)
            features = zip(weights, sums, strict=True)
            return [b.call(self.fma, [b.bitcast(w, _F32X), x, s]) for w, s in features]
        x_lo, x_hi = self._halves(pair)
        out = []
        for w, s in zip(weights, sums, strict=True):
            w_lo, w_hi = self._halves(w)
            out.append(b.call(self.fma, [w_hi, x_hi, b.call(self.fma, [w_lo, x_lo, s])]))
        return out

    def _halves(self, pairs: Any) -> tuple[Any, Any]:
        """Each lane's two bfloat16 (first in the low half) as two float32 vectors."""
        b = self.b
        lo = b.shl(pairs, ir.Constant(_I32X, [16] * LANES))
        hi = b.and_(pairs, ir.Constant(_I32X, [-(1 << 16)] * LANES))
        return b.bitcast(lo, _F32X), b.bitcast(hi, _F32X)

    def _prefetch(self, line: Any) -> None:
        """Ask for the step's two lines PREFETCH_BYTES ahead (read, keep in all caches)."""
        b = self.b
        flags = [ir.Constant(_I32, f) for f in (0, 3, 1)]
        for offset in (PREFETCH_BYTES, PREFETCH_BYTES + 64):
            ahead = b.gep(b.bitcast(line, _BYTE_PTR), [ir.Constant(_I64, offset)])
            b.call(self.prefetch, [ahead, *flags])


def _tile_product(operands: Operands) -> Any:
    """The intrinsic `product(tiles, t, x, r0, rows, acc)`: acc[r, :TILE] = tile t of
    `tiles` ([tiles, pairs, 2 * TILE] uint16, pairs >= 1) times row r0 + r of `x`
    ([rows, 2 * pairs] bfloat16 bits), for the first `rows` (1..PASS_ROWS) rows of `acc`
    ([PASS_ROWS, TILE] float32). The row count fixes how many accumulators a loop keeps,
    so the intrinsic holds one loop per count and switches to it (any other count does
    nothing). No bounds checks: the caller keeps t and r0 + rows in range. `operands`
    picks the loop (`BF16_DOT` only on a CPU that has the instruction). For `FLOAT32`
    the uint16 arrays are float32 ones viewed as uint16, a feature per "pair", and `x`
    is panels ([passes * features, 2 * rows per pass], `_panels`): r0 names the first
    line of the pass's panel and row r of the pass is its column r."""

    def typer(typingctx: Any, tiles: Any, t: Any, x: Any, r0: Any, rows: Any, acc: Any) -> Any:
        for name, arr, ndim, dtype in (
            ("tiles", tiles, 3, types.uint16),
            ("x", x, 2, types.uint16),
            ("acc", acc, 2, types.float32),
        ):
            ok = isinstance(arr, types.Array) and arr.layout == "C" and arr.ndim == ndim
            if not ok or arr.dtype != dtype:
                raise TypingError(f"{name} must be a C-contiguous {ndim}-D {dtype} array")
        sig = types.void(tiles, types.intp, x, types.intp, types.intp, acc)

        def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
            w_arr, x_arr, acc_arr = (
                context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 2, 5)
            )
            pairs = builder.extract_value(w_arr.shape, 1)
            x_stride = builder.lshr(builder.extract_value(x_arr.shape, 1), ir.Constant(_I64, 1))
            w32 = builder.bitcast(w_arr.data, _I32.as_pointer())
            tile_pairs = builder.mul(pairs, ir.Constant(_I64, TILE))  # i32 pairs in a tile
            w = builder.gep(w32, [builder.mul(args[1], tile_pairs)])
            x32 = builder.bitcast(x_arr.data, _I32.as_pointer())
            x0 = builder.gep(x32, [builder.mul(args[3], x_stride)])
            end = builder.append_basic_block("tile.end")
            switch = builder.switch(args[4], end)
            for rows in range(1, PASS_ROWS + 1):
                case = builder.append_basic_block(f"tile.rows{rows}")
                switch.add_case(ir.Constant(_I64, rows), case)
                builder.position_at_end(case)
                _TileLoop(builder, rows, operands).emit(w, pairs, x0, x_stride, acc_arr.data)
                builder.branch(end)
            builder.position_at_end(end)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


_PRODUCT = _tile_product(BF16_OPERANDS)
_PRODUCT_F32 = _tile_product(Operands.FLOAT32)


# Uncached, as matmul: they inline `bf16_bits`, which their file's stamp does not cover
# (see `decode_kernel._INLINED_DIGEST`).
@numba.njit(nogil=True)
def _as_bf16_pairs(x: np.ndarray, pairs: int) -> np.ndarray:
    """x [rows, n_in] float32 rounded to bfloat16 bits [rows, 2 * pairs], zero-padded."""
    out = np.zeros((x.shape[0], 2 * pairs), dtype=np.uint16)
    for r in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[r, j] = to_bf16(x[r, j])
    return out


@numba.njit(nogil=True)
def matmul(tiles: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out[r] = W @ x[r] for the packed weight `tiles` ([tiles, pairs, 2 * TILE] from
    `pack`), float32 `x` [rows, n_in] (rounded to bfloat16 here) and `out` [rows, n_out]
    (n_out at most tiles * TILE: the padding's outputs are dropped). Raises ValueError on
    shapes that disagree (the compiled loop has no bounds checks)."""
    rows, n_in = x.shape
    pairs = tiles.shape[1]
    if n_in < 1 or pairs != (n_in + 1) // 2 or tiles.shape[2] != 2 * TILE:
        raise ValueError("matmul: x's features do not match the packed weight's")
    _check_out(tiles, rows, out)
    _stream(tiles, _as_bf16_pairs(x, pairs), out, 0, tiles.shape[0], False)


# Cached on disk (compiling it takes about 10 s, which every engine process would pay at
# start): everything it compiles in is in this file, whose stamp the cache checks.
@numba.njit(nogil=True, cache=True)
def matmul_f32(tiles: np.ndarray, x: np.ndarray, out: np.ndarray, t0: int, t1: int) -> None:
    """out[r, cols of tiles t0..t1-1] = W @ x[r] for the float32 weight `tiles` (from
    `pack_f32`), `x` [rows, 2 * n_in] (float32 rows viewed as uint16) and float32 `out`
    [rows, n_out]. Threads may each take a range of tiles of one call: the ranges write
    disjoint columns and do not change any output's sum. Raises ValueError on shapes
    that disagree."""
    rows = x.shape[0]
    if x.shape[1] < 2 or tiles.shape[1] != x.shape[1] // 2 or tiles.shape[2] != 2 * TILE:
        raise ValueError("matmul_f32: x's features do not match the packed weight's")
    if not 0 <= t0 <= t1 <= tiles.shape[0]:
        raise ValueError("matmul_f32: the tile range is outside the packed weight")
    _check_out(tiles, rows, out)
    _stream(tiles, x, out, t0, t1, True)


@numba.njit(nogil=True)
def _panels(xb: np.ndarray, per_pass: int) -> np.ndarray:
    """float32 rows (viewed as uint16 [rows, 2 * n]) as one panel per pass of
    `per_pass` rows: line p * n + k holds feature k of the pass's rows, side by side
    (uint16 [passes * n, 2 * per_pass]; a short last pass leaves its columns zero)."""
    x = xb.view(np.float32)
    rows, n = x.shape
    passes = -(-rows // per_pass)
    panels = np.zeros((passes * n, per_pass), dtype=np.float32)
    # Written in panel order (reading a pass's rows side by side): written in row order,
    # each store lands on another line of a panel that outgrows the cache.
    for p in range(passes):
        count = min(per_pass, rows - p * per_pass)
        for k in range(n):
            line = panels[p * n + k]
            for c in range(count):
                line[c] = x[p * per_pass + c, k]
    return panels.view(np.uint16)


@numba.njit(nogil=True)
def _check_out(tiles: np.ndarray, rows: int, out: np.ndarray) -> None:
    if out.shape[0] != rows or out.shape[1] > tiles.shape[0] * TILE:
        raise ValueError("matmul: out's shape does not match x and the packed weight")


@numba.njit(nogil=True)
def _stream(
    tiles: np.ndarray, xb: np.ndarray, out: np.ndarray, t0: int, t1: int, f32: bool
) -> None:
    """Tiles t0..t1-1 times every row of `xb` into `out`, in passes of equal row counts
    (16 rows as 8 + 8). Every pass over a tile before the next tile: the tile (36 KiB
    of bfloat16 at 576 features) is then read from memory once and from cache by the
    later passes."""
    rows, n_out = xb.shape[0], out.shape[1]
    acc = np.empty((PASS_ROWS, TILE), dtype=np.float32)
    passes = -(-rows // PASS_ROWS)
    per_pass = max(-(-rows // max(passes, 1)), 1)
    panels = _panels(xb, per_pass) if f32 else xb
    features = tiles.shape[1]
    for t in range(t0, t1):
        o0 = t * TILE
        for r0 in range(0, rows, per_pass):
            count = min(per_pass, rows - r0)
            if f32:
                _PRODUCT_F32(tiles, t, panels, r0 // per_pass * features, count, acc)
            else:
                _PRODUCT(tiles, t, xb, r0, count, acc)
            for r in range(count):
                for c in range(min(TILE, n_out - o0)):
                    out[r0 + r, o0 + c] = acc[r, c]

"""bfloat16 values as the compiled CPU kernels hold them: uint16 bits, widened to float32
and rounded back (numba).

Lifecycle: `engine.decode_kernel` and `engine.weight_tiles` inline these into their
compiled code; nothing here holds state.

A bfloat16 is the top half of a float32's bits, so widening is a shift and rounding is
an add and a shift (to nearest, ties to even: torch's cast), with NaN kept a NaN.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic


def _bitcast_to_f32(typingctx, bits):  # type: ignore[no-untyped-def]
    """A uint32 reinterpreted as the float32 with those bits (no conversion)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


def _bitcast_to_u32(typingctx, value):  # type: ignore[no-untyped-def]
    """A float32's bits as a uint32."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


# Any: called only inside compiled code, where numba supplies the typing context.
#: bits_as_f32(uint32) -> float32 with those bits; f32_as_bits the other way.
bits_as_f32: Any = intrinsic(_bitcast_to_f32)
_f32_as_bits: Any = intrinsic(_bitcast_to_u32)


@numba.njit(cache=True, nogil=True, inline="always")
def widen(bits: np.uint16) -> np.float32:
    """bfloat16 bits (as uint16) as a float32: the top half of its bits."""
    return bits_as_f32(np.uint32(bits) << np.uint32(16))


@numba.njit(cache=True, nogil=True, inline="always")
def to_bf16(value: np.float32) -> np.uint16:
    """A float32 rounded to the nearest bfloat16 (ties to even), as torch casts; NaN
    stays a NaN."""
    bits = _f32_as_bits(value)
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(0x7FC0)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return np.uint16(rounded >> np.uint32(16))

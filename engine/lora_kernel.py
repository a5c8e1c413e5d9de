"""The fused decode's LoRA deltas (numba): each adapter's rows through its packed A and
B after a fused projection. The operands and why they look as they do:
`engine/fused_lora.py`.

Compiled into `engine.decode_kernel`'s entry points, which key their disk cache on this
file's digest (`decode_kernel._INLINED_DIGEST`), so it is not cached on its own.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from engine.weight_tiles import matmul

#: Arrays per adapter in the operand list (A and B for each of the four fused
#: projections); `engine.fused_lora.STRIDE`, which a test holds equal.
STRIDE = 8


@numba.njit(nogil=True)
def add_lora(
    x: np.ndarray, y: np.ndarray, ops: Any, slots: np.ndarray, layer: int, kind: int
) -> None:
    """y[r] += B @ (A @ x[r]) for every row r whose adapter (`slots[r]`, -1: none) has a
    delta for projection `kind` in `layer`; `ops` as `fused_lora.PackedAdapters.operands`
    builds it. Each adapter's rows are gathered and run as one product, so its weights
    are read once; a row's delta is its own (`weight_tiles.matmul`)."""
    for s in range(len(ops) // STRIDE):
        a = ops[s * STRIDE + 2 * kind]
        if a.shape[0] == 0:
            continue
        b = ops[s * STRIDE + 2 * kind + 1]
        count = 0
        for r in range(slots.shape[0]):
            count += slots[r] == s
        if count == 0:
            continue
        rows = np.empty(count, dtype=np.int64)
        xs = np.empty((count, x.shape[1]), dtype=np.float32)
        c = 0
        for r in range(slots.shape[0]):
            if slots[r] == s:
                rows[c] = r
                xs[c] = x[r]
                c += 1
        mid = np.empty((count, 2 * b.shape[2]), dtype=np.float32)
        matmul(a[layer], xs, mid)
        delta = np.empty((count, y.shape[1]), dtype=np.float32)
        matmul(b[layer], mid, delta)
        for c in range(count):
            y[rows[c]] += delta[c]

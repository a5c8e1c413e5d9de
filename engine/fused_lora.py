"""LoRA rows in the fused decode: each adapter's deltas packed in the kernel's tiles, and
the per-step list the kernel reads them from.

Lifecycle: `engine.fused_decode.FusedDecoder` owns one `PackedAdapters`. A fused step
whose rows name adapters asks it for the step's operands (`operands(adapters)`): each
adapter is packed the first time a step uses it (`pack_adapter`, from the `LoraAdapter`
that `engine/lora.py` read) and kept exactly as long as that `LoraAdapter` lives (the
`LoraSet` holds it while it is resident, each request while it runs), so a batch that
keeps its mix packs nothing after its first step and an evicted adapter's copy goes
with it. Nothing else holds the packed copies.

The kernel (`engine.decode_kernel`) applies them after each fused projection, one
adapter at a time over the rows that name it:

    mid = x[rows] @ A.T      (rounded to bfloat16 by `weight_tiles.matmul`, as torch's
    y[rows] += mid @ B.T      bf16 forward rounds its mid product)

with A [rank, in] and B [out, rank] of the fused projection (the scale folded into B,
`engine.lora.LoraPair`). A row pays for its own adapter only, where the torch forward's
one-hot mix (`engine/lora_batch.py`) multiplies every row by every adapter in the batch,
and since `matmul` gives each row the same bits alone or with others, a row's delta does
not depend on which rows share its step or its adapter: LoRA rows are batch-invariant
like the base rows. Each adapter's weights leave memory once per step, whatever the
number of its rows.

Layout of `operands`: a numba typed list of 4-d uint16 arrays, `STRIDE` per adapter in
the step's order: for each of `KINDS`, A's tiles then B's tiles, each [layers, tiles,
pairs, 2 * TILE] (`weight_tiles.pack` stacked over layers); a kind the adapter leaves
alone is an empty array ([0, 1, 1, 2 * TILE]), which the kernel skips. Layers the
adapter leaves alone, and ranks narrower than its widest layer's, are zeros: they add
exactly nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engine.lora import LoraAdapter

#: The fused projections in the kernel's order (its `kind` argument indexes this).
KINDS = ("qkv", "o", "gate_up", "down")
#: Arrays per adapter in `operands`: A and B for each kind.
STRIDE = 2 * len(KINDS)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def _empty() -> np.ndarray:
    from engine.weight_tiles import TILE

    return np.zeros((0, 1, 1, 2 * TILE), dtype=np.uint16)


def pack_adapter(adapter: LoraAdapter, layers: int) -> list[np.ndarray]:
    """`adapter`'s deltas as `STRIDE` packed arrays (see the module docstring)."""
    from engine.weight_tiles import pack

    out: list[np.ndarray] = []
    for kind in KINDS:
        pairs = {i: adapter.pairs.get(f"{i}.{kind}") for i in range(layers)}
        present = [p for p in pairs.values() if p is not None]
        if not present:
            out += [_empty(), _empty()]
            continue
        rank = max(p.rank for p in present)
        fan_in, fan_out = present[0].a_t.shape[0], present[0].b_t.shape[1]
        a = torch.zeros(layers, rank, fan_in, dtype=torch.bfloat16)
        b = torch.zeros(layers, fan_out, rank, dtype=torch.bfloat16)
        for i, p in pairs.items():
            if p is not None:
                a[i, : p.rank] = p.a_t.t().to(torch.bfloat16)
                b[i, :, : p.rank] = p.b_t.t().to(torch.bfloat16)
        out += [pack(_bits(a)), pack(_bits(b))]
    return out


def no_adapters() -> Any:
    """The empty operand list (a step without LoRA rows)."""
    from numba import typed, types

    return typed.List.empty_list(types.Array(types.uint16, 4, "C"))


class PackedAdapters:
    """Packed copies of the adapters fused steps used, each dropped when its adapter is
    (by `weakref.finalize`: an adapter re-read from disk is another object and packs
    again)."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self._packed: dict[int, list[np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self._packed)

    def operands(self, adapters: Sequence[LoraAdapter | None]) -> tuple[Any, np.ndarray]:
        """For rows whose adapters are `adapters` (None: the base model): the kernel's
        operand list and each row's index into it (int64 [rows], -1 for base rows)."""
        order: dict[int, int] = {}
        slots = np.full(len(adapters), -1, dtype=np.int64)
        ops = no_adapters()
        for r, adapter in enumerate(adapters):
            if adapter is None:
                continue
            slot = order.get(id(adapter))
            if slot is None:
                slot = order[id(adapter)] = len(order)
                for array in self._get(adapter):
                    ops.append(array)
            slots[r] = slot
        return ops, slots

    def _get(self, adapter: LoraAdapter) -> list[np.ndarray]:
        key = id(adapter)
        packed = self._packed.get(key)
        if packed is None:
            packed = self._packed[key] = pack_adapter(adapter, self.layers)
            # Keyed by identity, so dropped before the id can be reused.
            weakref.finalize(adapter, self._packed.pop, key, None)
        return packed

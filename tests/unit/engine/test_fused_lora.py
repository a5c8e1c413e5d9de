"""LoRA rows in the fused decode, piece by piece: the kernel's delta against a plain
reference, each row's delta its own, and the packed copies' lifetime
(`engine/fused_lora.py`, `engine/lora_kernel.py`). Whole engines with real adapters:
test_lora.py."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from engine import fused_lora, lora_kernel
from engine.lora import LoraAdapter, LoraPair

pytest.importorskip("numba")

BF16 = torch.bfloat16
LAYERS, HIDDEN, QKV = 2, 40, 56  # narrow, and not whole tiles: the padding is exercised


def _adapter(name: str, rank: int, seed: int, layers: tuple[int, ...] = (0, 1)) -> LoraAdapter:
    """An adapter with a qkv delta of `rank` on `layers` (the others left alone)."""
    gen = torch.Generator().manual_seed(seed)
    pairs = {
        f"{i}.qkv": LoraPair(
            torch.randn(HIDDEN, rank, generator=gen).to(BF16),
            (torch.randn(rank, QKV, generator=gen) * 0.1).to(BF16),
        )
        for i in layers
    }
    return LoraAdapter(name, f"digest-{name}", rank, pairs)


def _round(t: torch.Tensor) -> torch.Tensor:
    return t.to(BF16).double()


def _reference(x: torch.Tensor, adapter: LoraAdapter, layer: int) -> torch.Tensor:
    """x's delta in float64 from the bfloat16 inputs the kernel rounds to: x and mid
    rounded to bfloat16, as the torch forward rounds them."""
    pair = adapter.pairs.get(f"{layer}.qkv")
    if pair is None:
        return torch.zeros(x.shape[0], QKV, dtype=torch.float64)
    mid = _round(_round(x) @ pair.a_t.double())
    return mid @ pair.b_t.double()


def test_each_row_gets_its_own_adapters_delta() -> None:
    """Rows of two adapters (ranks 3 and 8, one of them on layer 1 only) and base rows,
    interleaved: each row's delta is its adapter's (within 1% of the delta's size: the
    kernel's float32 sums may round a mid value to the neighbouring bfloat16, 0.4% of
    it, where the float64 reference does not; another adapter's delta, or none, is
    off by about 100%), base rows and a layer the adapter leaves alone get exactly
    nothing, and a row's bits are the same as when it runs alone."""
    adapters = [_adapter("a", 3, seed=1), _adapter("b", 8, seed=2, layers=(1,))]
    packed = fused_lora.PackedAdapters(LAYERS)
    names = [0, None, 1, 0, 1, None, 0]
    rows = [None if n is None else adapters[n] for n in names]
    ops, slots = packed.operands(rows)
    assert list(slots) == [-1 if n is None else n for n in names]
    assert len(ops) == 2 * fused_lora.STRIDE == 2 * lora_kernel.STRIDE
    x = torch.randn(len(rows), HIDDEN, generator=torch.Generator().manual_seed(3))
    for layer in range(LAYERS):
        y0 = torch.randn(len(rows), QKV, generator=torch.Generator().manual_seed(4 + layer))
        y = y0.clone().numpy()
        lora_kernel.add_lora(x.numpy(), y, ops, slots, layer, 0)
        got = torch.from_numpy(y)
        for r, adapter in enumerate(rows):
            if adapter is None or f"{layer}.qkv" not in adapter.pairs:
                assert torch.equal(got[r], y0[r]), (layer, r)
                continue
            want = y0[r].double() + _reference(x[r : r + 1], adapter, layer)[0]
            size = float((want - y0[r].double()).norm())
            assert size > 0.1
            assert float((got[r].double() - want).norm()) <= 1e-2 * size, (layer, r)
            alone_ops, alone_slots = packed.operands([adapter])
            alone = y0[r : r + 1].clone().numpy()
            lora_kernel.add_lora(x[r : r + 1].numpy(), alone, alone_ops, alone_slots, layer, 0)
            assert np.array_equal(alone[0], y[r]), (layer, r)


def test_kinds_an_adapter_leaves_alone_are_empty() -> None:
    """Only qkv has a delta: the other kinds' operands are empty arrays (skipped)."""
    arrays = fused_lora.pack_adapter(_adapter("a", 4, seed=1), LAYERS)
    assert len(arrays) == fused_lora.STRIDE
    assert arrays[0].shape[0] == LAYERS and arrays[1].shape[0] == LAYERS
    assert all(a.shape[0] == 0 for a in arrays[2:])


def test_a_packed_copy_lives_as_long_as_its_adapter() -> None:
    packed = fused_lora.PackedAdapters(LAYERS)
    adapter = _adapter("a", 4, seed=1)
    first, _ = packed.operands([adapter, None, adapter])
    again, slots = packed.operands([None, adapter])
    assert len(packed) == 1 and list(slots) == [-1, 0]
    assert all(a is b for a, b in zip(first, again, strict=True))  # packed once
    replaced = _adapter("a", 4, seed=1)  # re-read from disk: another object, packed anew
    packed.operands([replaced])
    assert len(packed) == 2
    del adapter, first, again
    gc.collect()
    assert len(packed) == 1
    del replaced
    gc.collect()
    assert len(packed) == 0

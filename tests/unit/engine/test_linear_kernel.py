"""The linear kernels: oneDNN's pre-packed product equals F.linear (fp32 and bf16), the
tiled one too and the same bits on any thread split, int8 stays within its quantization
error, and the pick rules."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from engine import linear_kernel
from engine.config import EngineConfig
from engine.linear_kernel import (
    ONEDNN_MAX_ROWS,
    TILED_SPLIT_WORK,
    WIDEN_MIN_ROWS,
    Int8Linear,
    OneDnnLinear,
    TiledLinear,
    TorchLinear,
    onednn_packs_bf16,
    pick_linear_kernel,
)
from engine.precision import WeightQuant

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)
X86 = platform.machine().lower() in ("x86_64", "amd64")
needs_onednn_bf16 = pytest.mark.skipif(
    not onednn_packs_bf16(), reason="oneDNN on this CPU does not pack bf16 weights"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 16, ONEDNN_MAX_ROWS, ONEDNN_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_matches_torch_for_any_row_count(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(192, 576, generator=gen)
    bias = torch.randn(192, generator=gen) if with_bias else None
    x = torch.randn(rows, 576, generator=gen)
    kernel = OneDnnLinear()
    prepared = kernel.prepare(weight)
    assert prepared.packed is not None and prepared.packed.is_mkldnn
    got = kernel.apply(x, prepared, bias)
    assert got.shape == (rows, 192)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_torch_kernel_keeps_the_weight_as_loaded() -> None:
    weight = torch.randn(8, 4)
    kernel = TorchLinear()
    prepared = kernel.prepare(weight)
    assert prepared.plain is weight and prepared.packed is None
    x = torch.randn(3, 4)
    assert torch.equal(kernel.apply(x, prepared), F.linear(x, weight))


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_onednn_bf16_is_always_packed_and_matches_torch(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(192, 576, generator=gen).bfloat16()
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    kernel = pick_linear_kernel("onednn", CPU, torch.bfloat16)
    assert isinstance(kernel, OneDnnLinear) and kernel.max_rows is None
    prepared = kernel.prepare(weight)
    assert prepared.plain is None, "an always-packed weight keeps no second copy"
    got = kernel.apply(x, prepared)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_int8_is_within_its_quantization_error(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(256, 576, generator=gen)
    bias = torch.randn(256, generator=gen)
    x = torch.randn(rows, 576, generator=gen)
    x[0, 3] = 40.0  # an outlier: its column is multiplied in float, not int8
    kernel = Int8Linear()
    prepared = kernel.prepare(weight)
    assert prepared.plain is None, "the full-precision weight is dropped once quantized"
    got = kernel.apply(x, prepared, bias)
    want = F.linear(x, weight, bias)
    # Per row, the error is a small fraction of the row's output scale, the outlier's
    # row included.
    err = (got - want).norm(dim=1) / want.norm(dim=1)
    assert float(err.max()) < 0.02, err
    assert kernel.apply(x.bfloat16(), prepared).dtype == torch.bfloat16


def test_int8_multiplies_outlier_columns_in_float(monkeypatch: pytest.MonkeyPatch) -> None:
    """A channel at 24 on every token (as SmolLM2's normalized residual stream has) would
    set every row's int8 scale; split off, the other channels keep their resolution."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(256, 576, generator=gen)
    x = torch.randn(16, 576, generator=gen)
    x[:, [5, 77]] = 24.0
    kernel = Int8Linear()
    prepared = kernel.prepare(weight)
    want = F.linear(x, weight)

    def error() -> float:
        got = kernel.apply(x, prepared)
        return float(((got - want).norm(dim=1) / want.norm(dim=1)).max())

    split = error()
    monkeypatch.setattr(linear_kernel, "OUTLIER_THRESHOLD", float("inf"))
    unsplit = error()
    assert split < 0.01 and unsplit > 2 * split, (split, unsplit)


def test_int8_rows_do_not_depend_on_their_batch() -> None:
    """Outliers are split per activation, not per column: another row's outlier does not
    change how this row is quantized."""
    gen = torch.Generator().manual_seed(11)
    prepared = Int8Linear().prepare(torch.randn(96, 64, generator=gen))
    row = torch.randn(1, 64, generator=gen)
    other = torch.randn(1, 64, generator=gen)
    other[0, [3, 9, 40]] = 30.0  # outliers in columns where `row` has none
    alone = Int8Linear().apply(row, prepared)
    batched = Int8Linear().apply(torch.cat([other, row]), prepared)[1:]
    torch.testing.assert_close(batched, alone, rtol=1e-6, atol=1e-6)
    empty = Int8Linear().apply(torch.empty(0, 64), prepared)
    assert empty.shape == (0, 96)


@needs_onednn
def test_auto_packs_only_x86_cpu() -> None:
    packs = "onednn" if X86 else "torch"
    packs_bf16 = "onednn" if X86 and onednn_packs_bf16() else "torch"
    assert pick_linear_kernel("auto", CPU, torch.float32).name == packs
    assert pick_linear_kernel("auto", CPU, torch.bfloat16).name == packs_bf16
    assert pick_linear_kernel("auto", CPU, torch.float16).name == "torch"
    assert pick_linear_kernel("auto", torch.device("cuda"), torch.float32).name == "torch"
    assert pick_linear_kernel("torch", CPU, torch.float32).name == "torch"
    int8 = pick_linear_kernel("auto", CPU, torch.bfloat16, WeightQuant.INT8)
    assert int8.name == "int8" and int8.folds_norms


@needs_onednn
def test_where_onednn_cannot_pack_bf16_auto_takes_torch_and_onednn_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT, oneDNN's weight reorder
    raises on bf16; the pick must not hand such an engine a kernel that dies at load."""
    monkeypatch.setattr(linear_kernel, "onednn_packs_bf16", lambda: False)
    assert pick_linear_kernel("auto", CPU, torch.bfloat16).name == "torch"
    assert pick_linear_kernel("auto", CPU, torch.float32).name == ("onednn" if X86 else "torch")
    with pytest.raises(ValueError, match="bfloat16 only on a CPU whose oneDNN packs bf16"):
        pick_linear_kernel("onednn", CPU, torch.bfloat16)


@pytest.mark.parametrize("rows", [1, WIDEN_MIN_ROWS - 1, WIDEN_MIN_ROWS, 300])
def test_a_widened_bf16_product_rounds_a_float32_one(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without native bf16 the torch kernel multiplies bf16 in float32 from
    WIDEN_MIN_ROWS rows: one rounding of the exact-input float32 product, so each output
    is within half a bf16 ulp of it. Fewer rows keep bf16's own product."""
    monkeypatch.setattr(linear_kernel, "cpu_has_native_bf16", lambda: False)
    kernel = pick_linear_kernel("torch", CPU, torch.bfloat16)
    assert isinstance(kernel, TorchLinear) and kernel.widen
    assert not pick_linear_kernel("torch", CPU, torch.float32).widen  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(192, 576, generator=gen).bfloat16()
    bias = torch.randn(192, generator=gen).bfloat16()
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    prepared = kernel.prepare(weight)
    assert prepared.plain is weight, "the weight stays bf16"
    got = kernel.apply(x, prepared, bias)
    assert got.dtype == torch.bfloat16
    if rows < WIDEN_MIN_ROWS:
        assert torch.equal(got, F.linear(x, weight, bias))
        return
    exact = F.linear(x.double(), weight.double(), bias.double())
    assert torch.equal(got, F.linear(x.float(), weight.float(), bias.float()).bfloat16())
    half_ulp = exact.abs() * 2.0**-8 + 1e-3  # bf16 keeps 8 significant bits
    assert bool(((got.double() - exact).abs() <= half_ulp).all())


@pytest.mark.parametrize("rows", [0, 1, 13, 300])
def test_tiled_matches_torch_and_a_thread_split_changes_no_bit(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(700, 96, generator=gen), torch.randn(700, generator=gen)
    x = torch.randn(rows, 96, generator=gen)
    one, two = TiledLinear(threads=1), TiledLinear(threads=2)
    got = one.apply(x, one.prepare(weight), bias)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    split = two.apply(x, two.prepare(weight), bias)  # 300 rows: past TILED_SPLIT_WORK
    assert rows * 700 * 96 < TILED_SPLIT_WORK or rows == 300
    assert torch.equal(split, got)


def test_tiled_is_picked_by_name_and_refuses_other_dtypes() -> None:
    assert pick_linear_kernel("tiled", CPU, torch.float32).name == "tiled"
    with pytest.raises(ValueError, match="tiled needs device cpu and dtype float32"):
        pick_linear_kernel("tiled", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="tiled multiplies float32 weights"):
        TiledLinear().prepare(torch.ones(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="int8 has its own kernel"):
        pick_linear_kernel("tiled", CPU, torch.float32, WeightQuant.INT8)


def test_unusable_or_unknown_kernel_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="onednn needs device cpu, dtype float32 or bfloat16"):
        pick_linear_kernel("onednn", CPU, torch.float16)
    with pytest.raises(ValueError, match="int8 has its own kernel"):
        pick_linear_kernel("torch", CPU, torch.float32, WeightQuant.INT8)
    with pytest.raises(ValueError, match="linear_kernel must be one of"):
        pick_linear_kernel("mkl", CPU, torch.float32)
    with pytest.raises(ValueError, match="linear_kernel must be one of"):
        EngineConfig(linear_kernel="mkl")

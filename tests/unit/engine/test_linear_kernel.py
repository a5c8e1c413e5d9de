"""The linear kernels: oneDNN's pre-packed product equals F.linear, and the pick rules."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.linear_kernel import ONEDNN_MAX_ROWS, OneDnnLinear, TorchLinear, pick_linear_kernel

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)
X86 = platform.machine().lower() in ("x86_64", "amd64")


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


@needs_onednn
def test_auto_packs_only_x86_cpu_float32() -> None:
    assert pick_linear_kernel("auto", CPU, torch.float32).name == ("onednn" if X86 else "torch")
    assert pick_linear_kernel("auto", CPU, torch.bfloat16).name == "torch"
    assert pick_linear_kernel("auto", torch.device("cuda"), torch.float32).name == "torch"
    assert pick_linear_kernel("torch", CPU, torch.float32).name == "torch"


def test_unusable_or_unknown_kernel_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="onednn needs device cpu, dtype float32"):
        pick_linear_kernel("onednn", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="linear_kernel must be one of"):
        pick_linear_kernel("mkl", CPU, torch.float32)
    with pytest.raises(ValueError, match="linear_kernel must be one of"):
        EngineConfig(linear_kernel="mkl")

"""`engine.invariance`: which engines are batch-invariant and with which kernel, and the
clear refusals of `batch_invariant on` where it cannot be had."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, LinearKernelName
from engine.invariance import invariant_kernel

TILED = LinearKernelName.TILED


def _choice(**settings: object) -> tuple[LinearKernelName, bool]:
    got = invariant_kernel(EngineConfig(**settings))  # type: ignore[arg-type]
    return got.linear_kernel, got.invariant


def test_float32_on_cpu_is_invariant_by_default_through_the_tiled_kernel() -> None:
    assert _choice(dtype="float32") == (TILED, True)
    assert _choice(dtype="float32", batch_invariant="on", linear_kernel="tiled") == (TILED, True)


def test_off_keeps_the_kernel_asked_for() -> None:
    assert _choice(dtype="float32", batch_invariant="off") == (LinearKernelName.AUTO, False)
    assert _choice(dtype="float32", batch_invariant="off", linear_kernel="tiled") == (TILED, True)


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        ({"dtype": "bfloat16"}, "invariant kernels exist for float32 on the CPU only"),
        ({"dtype": "float32", "quantization": "int8"}, "quantization int8 has no invariant"),
        (
            {"dtype": "float32", "linear_kernel": "onednn"},
            "linear_kernel onednn sums rows in a batch-dep",
        ),
    ],
)
def test_where_it_has_no_kernels_auto_is_off_and_on_refuses(
    settings: dict[str, object], reason: str
) -> None:
    kernel, invariant = _choice(**settings)
    assert not invariant and kernel is not TILED
    with pytest.raises(ValueError, match=f"batch_invariant on: {reason}"):
        _choice(batch_invariant="on", **settings)


def test_an_unknown_value_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="batch_invariant must be one of auto, on, off"):
        EngineConfig(batch_invariant="always")  # type: ignore[arg-type]

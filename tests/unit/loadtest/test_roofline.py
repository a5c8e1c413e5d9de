"""The roofline benchmark's arithmetic and verdicts; its measurements run in `make bench`.

FLOP counts are checked against the model's real parameter count, the roofs against a
direct timing, and the targets against hand-made results on both sides of each bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.decode_roof import linear_flops, linear_weight_bytes, projections
from engine.model_spec import ModelSpec
from loadtest.engine import machine_roof
from loadtest.engine.machine_roof import gemm_roof
from loadtest.engine.roofline_bench import (
    DecodePoint,
    PrecisionResult,
    PrefillPoint,
    RooflineReport,
    attention_flops,
    format_table,
    targets,
)


@pytest.fixture(scope="module")
def spec(model_dir: Path) -> ModelSpec:
    return ModelSpec.from_dir(model_dir)


def test_flops_count_every_projection_weight_once(spec: ModelSpec, model_dir: Path) -> None:
    # The model's own tensors: every 2-D weight but the embedding, plus the tied LM head.
    params = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                shape = f.get_slice(name).get_shape()
                if len(shape) == 2 and "embed_tokens" not in name:
                    params += shape[0] * shape[1]
    if spec.tie_word_embeddings:
        params += spec.vocab_size * spec.hidden_size
    assert linear_flops(spec, 1, lm_head=True) == 2 * params
    assert linear_flops(spec, 7, lm_head=False) == 7 * linear_flops(spec, 1, lm_head=False)
    assert linear_weight_bytes(spec, 2) == 2 * params
    assert len(projections(spec, lm_head=True)) == 5


def test_attention_flops_grow_with_context(spec: ModelSpec) -> None:
    width = spec.num_heads * spec.head_dim
    assert attention_flops(spec, [0]) == 4 * width * spec.num_layers
    assert attention_flops(spec, range(4)) == 4 * width * spec.num_layers * (1 + 2 + 3 + 4)


def test_gemm_roof_is_a_real_rate(spec: ModelSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine_roof, "TIME_S", 0.02)
    torch.set_num_threads(1)
    small = ModelSpec(**{**spec.__dict__, "num_layers": 2})
    for dtype in ("float32", "bfloat16", "int8"):
        gflops = gemm_roof(small, dtype, 16, lm_head=False)
        assert 0.1 < gflops < 10_000, (dtype, gflops)
    # One row of bf16: the fused decode's products where the engine fuses, else oneDNN.
    assert 0.1 < gemm_roof(small, "bfloat16", 1, lm_head=True) < 10_000


def _result(prefill: float, b16: float, bw: float) -> PrecisionResult:
    return PrecisionResult(
        name="bfloat16",
        compute_dtype="bfloat16",
        prefill=[PrefillPoint(256, 500.0, prefill * 100, 100.0, prefill)],
        decode=[DecodePoint(16, 50.0, b16 * 100, 100.0, b16)],
        bandwidth_bound_ms=10.0,
        bandwidth_fraction=bw,
    )


def test_targets_hold_each_bound() -> None:
    met = targets([_result(0.6, 0.5, 0.7)])
    assert [t.met for t in met] == [True, True, True]
    missed = targets([_result(0.59, 0.49, 0.69)])
    assert [t.met for t in missed] == [False, False, False]
    assert targets([]) == []
    report = RooflineReport(bandwidth_gb_s=20.0, precisions=[_result(0.7, 0.4, 0.3)])
    report.targets = targets(report.precisions)
    table = format_table(report)
    assert "prefill 256" in table and "decode b16" in table and "NOT MET" in table


def test_a_roof_is_the_lesser_bound_and_never_below_a_measured_kernel(
    spec: ModelSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(machine_roof, "gemm_roof", lambda *a, **k: 5.0)
    # One row of bf16 reads 2 bytes per multiply-add: 1 FLOP per byte, so 20 GB/s of
    # reading bounds it at 20 GFLOPS, under a 1,000 GFLOPS peak.
    one = machine_roof.roof(spec, "bfloat16", 1, 2, 20.0, 1000.0, lm_head=True)
    assert one.memory_bound_gflops == pytest.approx(20.0)
    assert one.gflops == pytest.approx(20.0) and one.kernel_gflops == 5.0
    # 256 rows: the arithmetic bound (the peak) is the lesser.
    assert machine_roof.roof(spec, "bfloat16", 256, 2, 20.0, 1000.0, lm_head=False).gflops == 1000
    # A kernel measured above both bounds means a bound was measured low: the roof
    # takes the kernel's rate, so no fraction of it can exceed 1 on that account.
    monkeypatch.setattr(machine_roof, "gemm_roof", lambda *a, **k: 30.0)
    assert machine_roof.roof(spec, "bfloat16", 1, 2, 20.0, 1000.0, lm_head=True).gflops == 30


def test_peak_and_read_bandwidth_are_real_rates_above_the_model_shapes(
    spec: ModelSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(machine_roof, "TIME_S", 0.02)
    monkeypatch.setattr(machine_roof, "PEAK_SHAPES", ((256, 512, 512),))
    torch.set_num_threads(1)
    for dtype in ("float32", "int8"):
        assert 0.5 < machine_roof.peak_gflops(dtype) < 100_000, dtype
    bw = machine_roof.read_bandwidth()
    assert 0.5 < bw < 2_000
    assert torch.get_num_threads() == 1  # restored after the all-core measurement

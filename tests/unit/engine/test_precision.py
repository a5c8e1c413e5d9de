"""Precision choices: what `dtype auto` resolves to, the config's enums and refusals, and
the weights' format in the model fingerprint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import precision
from engine.config import EngineConfig
from engine.kv_layout import KvLayout
from engine.model_spec import ModelSpec
from engine.precision import DType, WeightQuant, resolve_dtype

CPU = torch.device("cpu")


def _flags(monkeypatch: pytest.MonkeyPatch, flags: set[str]) -> None:
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset(flags))


def test_auto_is_bf16_only_where_the_cpu_computes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _flags(monkeypatch, {"avx512f", "avx512_bf16"})
    assert resolve_dtype(DType.AUTO, CPU) == torch.bfloat16
    _flags(monkeypatch, {"amx_bf16"})
    assert resolve_dtype(DType.AUTO, CPU) == torch.bfloat16
    _flags(monkeypatch, {"avx2", "avx512f"})  # no bf16 dot products: emulated, no gain
    assert resolve_dtype(DType.AUTO, CPU) == torch.float32
    assert resolve_dtype(DType.AUTO, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype(DType.FLOAT32, CPU) == torch.float32  # an explicit flag wins


def test_this_hosts_flags_are_read() -> None:
    flags = precision.cpu_flags()
    if Path("/proc/cpuinfo").exists():
        assert flags, "Linux lists CPU flags in /proc/cpuinfo"
    assert precision.cpu_has_native_bf16() == bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def test_config_takes_names_and_refuses_unknown_ones() -> None:
    cfg = EngineConfig(dtype="bfloat16", quantization="int8")  # type: ignore[arg-type]
    assert cfg.dtype is DType.BFLOAT16 and cfg.quantization is WeightQuant.INT8
    with pytest.raises(ValueError, match="dtype must be one of auto, float32"):
        EngineConfig(dtype="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="quantization must be one of none, int8"):
        EngineConfig(quantization="int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="int8 runs on the CPU only"):
        EngineConfig(quantization=WeightQuant.INT8, device="cuda")


def test_weights_format_is_part_of_the_fingerprint(model_dir: Path) -> None:
    spec = ModelSpec.from_dir(model_dir)
    assert spec.with_weights("none") is spec
    int8 = spec.with_weights("int8")
    assert int8.fingerprint != spec.fingerprint
    assert int8.fingerprint == ModelSpec.from_dir(model_dir).with_weights("int8").fingerprint
    # So the KV layouts (compared at every handshake) and prefix-cache keys differ too.
    full = KvLayout.from_spec(spec, torch.float32, 16, CPU).fingerprint()
    assert KvLayout.from_spec(int8, torch.float32, 16, CPU).fingerprint() != full
    assert KvLayout.from_spec(spec, torch.bfloat16, 16, CPU).fingerprint() != full

"""Real engines whose KV blocks have one shape but whose arithmetic differs refuse each
other's KV at the handshake, the refusal naming both sides' values.

Two tiny engines on one model directory, both with an 8-bit (int8) KV cache: the stored
dtype is the same, so before the numerics joined the layout they exchanged blocks that
one computed in bfloat16 and the other would have computed in float32.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import LLMEngine
from kvtransfer.config import TransferConfig
from kvtransfer.errors import LayoutMismatchError
from kvtransfer.exporter import KvExporter
from kvtransfer.importer import handshake, handshake_offer
from tests.tiny_models import write_tiny_model

TCP = TransferConfig(kv_backend="tcp", kv_transfer_timeout_s=10.0)


def _engine(model: Path, dtype: str, linear: str = "auto", invariant: str = "auto") -> LLMEngine:
    cfg = EngineConfig(model=str(model), dtype=dtype, kv_cache_dtype="int8",  # type: ignore[arg-type]
                       linear_kernel=linear, num_kv_blocks=16,  # type: ignore[arg-type]
                       batch_invariant=invariant)  # type: ignore[arg-type]  # fmt: skip
    return LLMEngine(cfg)


def _tiny(tmp_path: Path) -> Path:
    write_tiny_model("llama3", tmp_path / "tiny")
    return tmp_path / "tiny"


def test_an_8bit_cache_computed_in_another_dtype_is_refused_by_name(tmp_path: Path) -> None:
    model = _tiny(tmp_path)
    bf16, fp32 = _engine(model, "bfloat16"), _engine(model, "float32")
    assert bf16.layout.dtype == fp32.layout.dtype == "int8"
    assert (bf16.layout.compute_dtype, fp32.layout.compute_dtype) == ("bfloat16", "float32")
    assert bf16.layout.fingerprint() != fp32.layout.fingerprint()
    exporter = KvExporter(bf16.handoff, TCP, engine_id="bf16").start()
    try:
        deadline = time.monotonic() + 10
        with pytest.raises(
            LayoutMismatchError, match="compute_dtype: exporter 'bfloat16' vs importer 'float32'"
        ):
            handshake(exporter.address, handshake_offer(fp32.layout, "fp32"), deadline)
        # An engine of the same numerics is let in.
        twin = _engine(model, "bfloat16")
        assert twin.layout == bf16.layout
        handshake(exporter.address, handshake_offer(twin.layout, "twin"), deadline)
    finally:
        exporter.close()


def test_the_kernels_that_computed_a_block_are_in_its_layout(tmp_path: Path) -> None:
    model = _tiny(tmp_path)
    plain = _engine(model, "float32", linear="torch")
    assert plain.layout.kernels == "linear=torch decode=torch attention=torch"
    assert "computed in float32 by linear=torch" in plain.layout.describe()
    # float32 on the CPU is batch-invariant by default: the tiled kernel.
    invariant = _engine(model, "float32")
    assert invariant.layout.kernels.startswith("linear=tiled")
    assert invariant.layout.fingerprint() != plain.layout.fingerprint()
    auto = _engine(model, "float32", invariant="off")
    if auto.model.kernel.name == "torch":
        pytest.skip("this CPU has no oneDNN linear kernel: auto picks torch too")
    assert auto.layout.kernels.startswith("linear=onednn")
    assert len({auto.layout.fingerprint(), invariant.layout.fingerprint()}) == 2

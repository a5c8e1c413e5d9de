"""On CUDA: the block-major pool, 8-bit KV caches and the offload tier (pinned host memory).

A tiny model (tests/tiny_models.py) in fp32 so the CPU engine is an exact reference for
the unquantized cache; the 8-bit caches must agree with their own CPU runs on the first
tokens (same quantization arithmetic, different kernels), and a prefix evicted to the
pinned tier must come back with the same output, leak-free.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import assert_no_leaks
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.gpu
PROMPTS = [[1, 5, 9, 13, 2, 7] * k for k in (1, 3, 6)]


def _engine(model: Path, device: str, **over: object) -> LLMEngine:
    settings: dict[str, object] = {"model": str(model), "dtype": "float32", "num_kv_blocks": 64,
                                   "attention_backend": "torch", "device": device}  # fmt: skip
    settings.update(over)
    return LLMEngine(EngineConfig(**settings))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "llama3"
    write_tiny_model("llama3", path)
    return path


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8_e4m3"])
def test_cuda_cache_matches_cpu(model: Path, kv_dtype: str) -> None:
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    gpu = _engine(model, "cuda", kv_cache_dtype=kv_dtype)
    cpu = _engine(model, "cpu", kv_cache_dtype=kv_dtype)
    assert gpu.kv_blocks.is_cuda and gpu.kv_blocks.shape == cpu.kv_blocks.shape
    got, want = gpu.generate(PROMPTS, params), cpu.generate(PROMPTS, params)
    if kv_dtype == "auto":
        assert got == want
    else:
        assert sum(g[:4] == w[:4] for g, w in zip(got, want, strict=True)) >= len(PROMPTS) - 1
    assert_no_leaks(gpu)


def test_cuda_offload_tier_is_pinned_and_restores(model: Path) -> None:
    gpu = _engine(model, "cuda", num_kv_blocks=12, kv_offload_bytes=64 << 20)
    assert gpu.offload is not None and gpu.offload._arena.is_pinned()
    first, other = [3 + i % 50 for i in range(120)], [60 + i % 40 for i in range(120)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    (want,) = gpu.generate([first], params)
    gpu.generate([other], params)  # evicts `first` into the tier
    (got,) = gpu.generate([first], params)
    assert got == want and gpu.stats().offload_restored_total > 0
    assert torch.cuda.is_available()
    assert_no_leaks(gpu)


def test_cuda_restores_are_timed_and_the_decode_roof_measured(model: Path) -> None:
    """The restore gate's copy time and the decode roof's bandwidth, on the device: a
    pinned-to-device copy is timed (it is synchronous), and the start-up probe reads
    device memory (a GPU's is far above a CPU's 10-30 GB/s)."""
    gpu = _engine(model, "cuda", num_kv_blocks=12, kv_offload_bytes=64 << 20)
    first, other = [3 + i % 50 for i in range(120)], [60 + i % 40 for i in range(120)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    gpu.generate([first], params)
    gpu.generate([other], params)
    gpu.generate([first], params)
    tier = gpu.offload.stats() if gpu.offload is not None else None
    assert tier is not None and tier.restored > 0 and tier.restore_s > 0
    assert gpu.stats().memory_bandwidth_bytes_s > 100e9
    assert gpu.stats().decode_roof_s_total > 0
    assert_no_leaks(gpu)

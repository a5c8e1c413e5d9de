"""On CUDA: speculative decoding leaves output token-identical (greedy and seeded), on a
tiny model in float32, with the drafts verified in the batched step and rolled back on
the GPU pool, leak-free. A random tiny model seldom repeats itself, so the drafts are
forced (three copies of one token: mostly rejected, sometimes kept), which is what
exercises the verification and the rollback."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.conftest import assert_no_leaks
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.gpu


def test_speculation_on_cuda_is_token_identical(tmp_path: Path) -> None:
    model = tmp_path / "llama3"
    write_tiny_model("llama3", model)
    common = {"model": str(model), "dtype": "float32", "num_kv_blocks": 64, "device": "cuda",
              "attention_backend": "torch"}  # fmt: skip
    off = LLMEngine(EngineConfig(**common))  # type: ignore[arg-type]
    on = LLMEngine(EngineConfig(speculative_decoding="on", **common))  # type: ignore[arg-type]
    on.speculator.propose = _force_drafts  # type: ignore[method-assign]
    prompts = [[1, 5, 9, 13, 2, 7] * k for k in (2, 4, 8)]
    seeded = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.9, seed=4)
    for params in (SamplingParams(max_tokens=64, ignore_eos=True), seeded):
        assert on.generate(prompts, params) == off.generate(prompts, params)
    assert on.speculator.drafted_total > 0
    assert_no_leaks(on)


def _force_drafts(decodes: Sequence[Request]) -> None:
    for req in decodes:
        room = req.sampling.max_tokens - len(req.output_token_ids) - 1
        req.draft_token_ids = [7] * max(0, min(3, room))

"""The decode roof: the least time a decode step's reads can take, and the meter that sets
each decode-only step's wall time beside it (the workers' fraction-of-roof metrics).

The arithmetic alone, then a tiny real model with the bandwidth given, where the
roof's total is checked exactly against the steps the engine ran: one stream, so every
step after the first is a decode whose context is known.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.decode_roof import DecodeRoof, linear_weight_bytes, read_bandwidth
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import assert_no_leaks
from tests.tiny_models import write_tiny_model


def test_a_steps_roof_is_its_reads_over_the_bandwidth() -> None:
    roof = DecodeRoof(weight_bytes=1e9, kv_bytes_per_token=1000, bandwidth_bytes_s=1e10)
    assert roof.step_s(0) == pytest.approx(0.1)
    assert roof.step_s(1_000_000) == pytest.approx(0.2)  # 1 GB of context doubles it


def test_the_bandwidth_probe_reads_its_buffer() -> None:
    bandwidth = read_bandwidth(torch.device("cpu"))
    assert 1e8 < bandwidth < 1e13  # between 0.1 GB/s and 10 TB/s: a number, measured


def test_the_engine_meters_decode_only_steps_against_the_roof(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir: Path = tmp_path_factory.mktemp("tiny") / "qwen2"
    write_tiny_model("qwen2", model_dir)
    config = EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=32,
                          memory_bandwidth_gb_s=2.0, speculative_decoding="off")  # fmt: skip
    engine = LLMEngine(config)
    prompt, tokens = list(range(3, 43)), 9  # 40 tokens: one prefill step, then 8 decodes
    before = engine.stats()
    engine.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True))
    after = engine.stats()
    weights = linear_weight_bytes(engine.spec, 4)
    contexts = sum(range(len(prompt), len(prompt) + tokens - 1))  # what each decode reads
    expected = ((tokens - 1) * weights + contexts * engine.layout.bytes_per_token) / 2e9
    assert after.decode_roof_s_total - before.decode_roof_s_total == pytest.approx(expected)
    busy = after.decode_only_busy_s_total - before.decode_only_busy_s_total
    assert 0 < busy < after.busy_s_total - before.busy_s_total  # the prefill step is not in it
    assert after.memory_bandwidth_bytes_s == 2e9
    assert_no_leaks(engine)

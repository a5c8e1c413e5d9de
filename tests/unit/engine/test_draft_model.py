"""Speculative decoding with a draft model (`engine/draft_model.py`), checked with the
served model as its own draft: it proposes what it will verify, so greedy acceptance is
1.0 (up to chunked-vs-one-token rounding), and greedy and seeded output is unchanged.
A draft of another vocabulary is refused by name. Leak checks cover the draft's own
pool and shadows."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import SHORT
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def pair(make_engine: EngineFactory, model_dir: Path) -> tuple[LLMEngine, LLMEngine]:
    off = make_engine(kv_cache_bytes=64 << 20)
    self_drafted = make_engine(kv_cache_bytes=64 << 20, speculative_decoding="on",
                               spec_draft_model=str(model_dir),
                               spec_draft_kv_cache_bytes=32 << 20)  # fmt: skip
    return off, self_drafted


def test_the_model_as_its_own_draft_is_accepted_and_changes_nothing(
    pair: tuple[LLMEngine, LLMEngine],
) -> None:
    off, spec = pair
    prompts = [off.tokenizer.encode(t) for t in SHORT[:3]]
    greedy = SamplingParams(max_tokens=20)
    assert spec.generate(prompts, greedy) == off.generate(prompts, greedy)
    stats = spec.stats()
    assert stats.spec_drafted_total > 20
    assert stats.spec_acceptance_rate >= 0.95, stats  # 1.0 but for rounding
    seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=21)
    assert spec.generate(prompts, seeded) == off.generate(prompts, seeded)
    assert_no_leaks(spec)


def test_a_draft_model_of_another_vocabulary_is_refused(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    tiny = tmp_path / "llama3"
    write_tiny_model("llama3", tiny)
    with pytest.raises(ValueError, match="spec_draft_model: its vocabulary"):
        make_engine(speculative_decoding="on", spec_draft_model=str(tiny))

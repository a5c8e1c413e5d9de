"""Greedy output equals HF transformers token for token, batched and one at a time, also
with speculative decoding on (every draft the n-gram finds verified)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import ChatMessage
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import CHAT, SHORT, long_prompt

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(kv_cache_bytes=256 << 20, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def prompts(engine: LLMEngine) -> list[list[int]]:
    tok = engine.tokenizer
    out = [tok.encode(p) for p in SHORT]
    out += [tok.encode_chat([ChatMessage("user", c)]) for c in CHAT]
    out += [tok.encode(long_prompt(9)), tok.encode(long_prompt(12))]
    out.append(tok.encode_chat([ChatMessage("user", long_prompt(10) + " Summarise it.")]))
    return out


@pytest.fixture(scope="module")
def reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    refs = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=2,
            )
            refs.append(out[0, len(p) :].tolist())
    return refs


def _strip_eos(tokens: list[int]) -> list[int]:
    # HF keeps emitting nothing after EOS within a batch of one; the engine stops at EOS.
    return tokens[: tokens.index(2) + 1] if 2 in tokens else tokens


def test_prompt_set_is_varied(prompts: list[list[int]]) -> None:
    assert len(prompts) >= 20
    assert max(len(p) for p in prompts) >= 1000
    assert min(len(p) for p in prompts) < 16


def test_batched_matches_transformers(
    engine: LLMEngine, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    got = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    for i, (g, r) in enumerate(zip(got, reference, strict=True)):
        assert g == _strip_eos(r), f"prompt {i} ({len(prompts[i])} tokens) diverged"
    assert_no_leaks(engine)


@pytest.fixture(scope="module")
def speculating(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(kv_cache_bytes=256 << 20, max_num_batched_tokens=512,
                       speculative_decoding="on")  # fmt: skip


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "alone"])
def test_speculative_decoding_matches_transformers(
    speculating: LLMEngine, prompts: list[list[int]], reference: list[list[int]], batched: bool
) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS)
    before = speculating.speculator.accepted_total
    if batched:
        got = speculating.generate(prompts, params)
    else:
        got = [speculating.generate([p], params)[0] for p in prompts]
    for i, (g, r) in enumerate(zip(got, reference, strict=True)):
        assert g == _strip_eos(r), f"prompt {i} ({len(prompts[i])} tokens) diverged"
    assert speculating.speculator.accepted_total > before  # drafts verified, some kept
    assert_no_leaks(speculating)


def test_one_at_a_time_matches_transformers(
    engine: LLMEngine, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    for i, (p, r) in enumerate(zip(prompts, reference, strict=True)):
        (g,) = engine.generate([p], SamplingParams(max_tokens=MAX_TOKENS))
        assert g == _strip_eos(r), f"prompt {i} ({len(p)} tokens) diverged"
    assert_no_leaks(engine)


def test_warm_prefix_cache_gives_same_tokens_and_hits(
    make_engine: EngineFactory, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    eng = make_engine(kv_cache_bytes=256 << 20)
    cold = eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    hits_before = eng.stats().prefix_hit_tokens
    warm = eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert warm == cold
    assert warm == [_strip_eos(r) for r in reference]
    s = eng.stats()
    assert s.prefix_hit_tokens - hits_before > 0
    assert s.prefix_hit_ratio > 0
    assert_no_leaks(eng)


def test_prefix_restored_from_the_offload_tier_matches_transformers(
    make_engine: EngineFactory, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """A pool too small for the prompt set: the second pass finds most prefixes only in
    the offload tier, copies them back, and still matches HF token for token."""
    eng = make_engine(num_kv_blocks=128, kv_offload_bytes=512 << 20)
    eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    evictor = [17 + (i * 7919) % 40000 for i in range(1400)]  # shares no block
    eng.generate([evictor], SamplingParams(max_tokens=1))
    warm = eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert warm == [_strip_eos(r) for r in reference]
    s = eng.stats()
    assert s.offload_restored_total > 20 and s.offload_hit_tokens > 0, s
    assert_no_leaks(eng)

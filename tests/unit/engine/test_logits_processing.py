"""Penalties, logit_bias, min_tokens and min_p: each against a plain per-row reference, a
batch mixing them equal to each request alone, and repetition_penalty token-exact with HF
transformers' generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.engine import LLMEngine
from engine.logits_processing import RowContext, process
from engine.sampler import new_generator, sample
from engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory, assert_no_leaks

VOCAB = 40


def _logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(7)) * 3


def _reference(row: torch.Tensor, ctx: RowContext, eos: set[int]) -> torch.Tensor:
    """One row, the slow and obvious way."""
    out = row.clone()
    p = ctx.params
    for t in {*ctx.prompt, *ctx.output}:
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(ctx.output):
        count = list(ctx.output).count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty
    for t, b in p.logit_bias:
        out[t] += b
    if len(ctx.output) < p.min_tokens:
        for t in {*eos, *p.stop_token_ids}:
            out[t] = float("-inf")
    return out


def test_batched_processing_equals_the_per_row_reference() -> None:
    contexts = [
        RowContext(SamplingParams(), [1, 2], [3]),
        RowContext(SamplingParams(repetition_penalty=1.5), [1, 2, 5], [5, 6]),
        RowContext(SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4), [9], [4, 4, 8]),
        RowContext(SamplingParams(logit_bias=((3, 5.0), (7, -100.0))), [1], []),
        RowContext(SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(11,)), [1], [2]),
        RowContext(SamplingParams(max_tokens=8, min_tokens=1), [1], [2]),  # reached: no mask
    ]
    logits = _logits(len(contexts))
    out = process(logits, contexts, {0})
    for i, ctx in enumerate(contexts):
        assert torch.allclose(out[i], _reference(logits[i], ctx, {0}), atol=1e-5), i
    assert out[4, 0] == float("-inf") and out[4, 11] == float("-inf")
    assert process(logits, contexts[:1], {0}) is logits  # nothing to do: no copy


def test_allowed_mask_and_a_row_left_empty_falls_back() -> None:
    logits = _logits(2)
    allowed = torch.zeros(2, VOCAB, dtype=torch.bool)
    allowed[0, 5] = True  # row 1 allows nothing: it samples from its raw logits
    ctx = [RowContext(SamplingParams(), [1], [])] * 2
    tokens = sample(logits, [SamplingParams()] * 2, [None, None], contexts=ctx, allowed=allowed)
    assert tokens == [5, int(logits[1].argmax())]


def test_min_p_one_is_greedy() -> None:
    logits = _logits(1)
    p = SamplingParams(temperature=1.0, min_p=1.0)
    draws = {sample(logits, [p], [new_generator(s)])[0] for s in range(20)}
    assert draws == {int(logits[0].argmax())}


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(kv_cache_bytes=64 << 20)


def test_a_mixed_batch_equals_each_request_alone(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode("List some colors: red, blue, green,")
    params = [
        SamplingParams(max_tokens=12, temperature=0.8, seed=1, presence_penalty=1.5),
        SamplingParams(max_tokens=12, temperature=0.8, seed=2),
        SamplingParams(max_tokens=12, repetition_penalty=1.4),
        SamplingParams(max_tokens=12, temperature=0.9, seed=3, frequency_penalty=2.0, min_p=0.1),
    ]
    together = engine.generate([prompt] * len(params), params)
    alone = [engine.generate([prompt], p)[0] for p in params]
    assert together == alone
    plain = engine.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert plain != together[2]  # the penalty changed something
    assert_no_leaks(engine)


def test_min_tokens_outlasts_a_forced_eos(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode("Hello")
    eos = engine.tokenizer.eos_token_id
    assert eos is not None
    forced = SamplingParams(max_tokens=6, logit_bias=((eos, 100.0),))
    assert engine.generate([prompt], forced)[0] == [eos]
    held = SamplingParams(max_tokens=6, min_tokens=4, logit_bias=((eos, 100.0),))
    out = engine.generate([prompt], held)[0]
    assert len(out) == 5 and out[-1] == eos and eos not in out[:4]


def test_repetition_penalty_equals_hf_generate(engine: LLMEngine, model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = engine.tokenizer.encode("The cat sat on the mat. The cat sat on the")
    ours = engine.generate([prompt], SamplingParams(max_tokens=16, repetition_penalty=1.3))[0]
    with torch.inference_mode():
        ref = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.3,
            pad_token_id=2,
        )[0, len(prompt) :].tolist()
    assert ours == ref[: len(ours)]
